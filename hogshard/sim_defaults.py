"""The simulator's defaults, read by :class:`hogshard.sim.SimConfig` and by ``hogshard
simulate`` alike (kept out of ``hogshard.sim`` so that the CLI reads them without importing
the simulator).

The default recipe is Rudra's: plain SGD at a constant rate on the simulator's small MLP, one
epoch of the whole training set, batch 16 a learner. Under it ``softsync:N+lr=mean`` (alpha0
divided by the mean staleness) ends within a point of ``hardsync`` at every N, as Rudra found
(docs/POLICIES.md; benchmarks/RESULTS.md, "The simulator's defaults"). The example's own recipe
(its CNN under adam 1e-3, batch 64) is one flag set away: ``--model cnn --rule adam --lr 1e-3
--batch 64``.

Example::

    >>> from hogshard import sim_defaults
    >>> sim_defaults.RULE, sim_defaults.LR, sim_defaults.BATCH, sim_defaults.MODEL
    ('sgd', 0.05, 16, 'mlp')
"""

LEARNERS = 4
SERVERS = 1
POLICY = "async"
MODEL = "mlp"
RULE = "sgd"
LR = 0.05
MOMENTUM = 0.9
BATCH = 16
EPOCHS = 1
#: A learner's mean compute time per step (simulated seconds) and its log-normal spread.
COMPUTE_S = 0.02
JITTER = 0.1
EVAL_SUBSET = 1000
#: With a synthetic model (``parameters``): each learner's steps per epoch.
STEPS = 20
