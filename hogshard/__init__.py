"""hogshard: a parameter server for asynchronous SGD over ZeroMQ.

=====================  =============================================================================
``__main__.py``        ``python -m hogshard``: runs the ``hogshard`` command
``cli.py``             ``main``: the ``hogshard`` command; starts each role, launches a job
``job_cli.py``         ``hogshard status/policy/checkpoint/stop/export``: acts on a running job
``keys_cli.py``        ``hogshard keys``: CURVE keypairs for a cluster, one per role
``cli_options.py``     the flags the commands share; bad values as usage errors, not tracebacks
``config_file.py``     ``config_defaults``: ``--config job.toml``, defaults per command
``logs.py``            ``configure_logging``: one line per event as text, logfmt or JSON
``launcher.py``        :class:`LocalCluster`: a whole job on this host, supervised to its end
``children.py``        ``worker_environment``, :class:`JobOutput`: the processes of a launched job
``chaos.py``           :class:`Storm`: seeded kill/stop faults against a launched job, recovery timed
``chaos_partition.py`` :class:`Partitions`: iptables cuts between exactly two processes, healed
``slurm.py``           ``slurm``, ``plan_task``, ``expand_nodelist``: a job brought up under SLURM
``status.py``          :class:`ClusterView`: a readable view of the scheduler's ``status`` reply
``live_status.py``     ``status_panel``, ``watch``: the ``hogshard status`` table drawn with rich
``status_page.py``    :class:`StatusPage`: the scheduler's live status page (``--http-port``)
``page_data.py``      :class:`PageData`: the page's snapshot, plot history and warning lines
``page_cli.py``       ``page_options``, ``start_page``: the page's flags on ``hogshard scheduler``
``page/``             the page's HTML, script and style (package data)
``embeddings_cli.py``  ``hogshard embeddings``: embedding slots moved between servers
``simulate.py``        ``hogshard simulate``: a whole job in one process (``sim/``)
``sim_defaults.py``    the simulator's defaults (Rudra's recipe), read by ``SimConfig`` and the CLI
``report.py``          ``hogshard report``: loss, accuracy and staleness of runs, plotted
``tuning.py``          ``tune_server_process``, ``single_threaded_blas``: settings for large frames
``datasets.py``        ``load_image_dataset``, ``load_fashion_mnist``: data sets from local files
``recsys_data.py``     ``load_open_bandit``, ``synthetic_criteo``, ``auc``: click data for DLRM
``sim/``               :class:`Simulation`: a cluster simulator on a discrete-event clock
=====================  =============================================================================

Example (inside a process started by ``hogshard worker`` or ``hogshard launch``)::

    from hogshard import PSClient, PSOptimizer
    client = PSClient.from_env()
    opt = PSOptimizer(client, model.named_parameters(), rule="sgd", lr=0.1)
    for x, y in client.shard((images, labels), batch_size=64, epochs=2):  # this rank's share
        ...
    client.finish()  # every rank trained; the model holds the final weights; left the job
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from hogshard.worker.client import PSClient
    from hogshard.worker.embedding import RemoteEmbeddingBag
    from hogshard.worker.optimizer import PSOptimizer
    from hogshard.worker.remote_modules import RemoteEmbedding, remote_embeddings
    from hogshard.worker.shard import Shard, ShardSampler

__all__ = ["PSClient", "PSOptimizer", "RemoteEmbedding", "RemoteEmbeddingBag", "Shard",
           "ShardSampler", "__version__", "remote_embeddings"]


def __getattr__(name: str) -> Any:
    # Lazy, so that servers and the scheduler (which share this package) never import torch.
    if name == "PSClient":
        from hogshard.worker.client import PSClient

        return PSClient
    if name == "PSOptimizer":
        from hogshard.worker.optimizer import PSOptimizer

        return PSOptimizer
    if name == "RemoteEmbeddingBag":
        from hogshard.worker.embedding import RemoteEmbeddingBag

        return RemoteEmbeddingBag
    if name in ("RemoteEmbedding", "remote_embeddings"):
        from hogshard.worker import remote_modules

        return getattr(remote_modules, name)
    if name in ("Shard", "ShardSampler"):
        from hogshard.worker import shard

        return getattr(shard, name)
    raise AttributeError(f"module 'hogshard' has no attribute {name!r}")
