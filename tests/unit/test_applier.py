"""Unit tests of hogshard.ps.applier.UpdateApplier: each consistency policy's decisions (when a
gradient is applied, what a pull waits for, what is dropped), driven directly on a DenseStore
with server-side SGD (lr 1), so every applied update can be computed by hand. No sockets.

The pull gate (the applier's open steps, then the workers' clocks in ps/workers.py) at the end.
"""

from __future__ import annotations

import numpy as np
import pytest

from hogshard.proto.errors import ConflictError
from hogshard.proto.policy import parse_policy
from hogshard.ps.applier import UpdateApplier
from hogshard.ps.dense import DenseChunk, DenseStore, DenseTable
from hogshard.ps.executor import InlineUpdates
from hogshard.ps.stats import ServerStats
from hogshard.ps.workers import WorkerView

F32 = np.dtype("<f4")
WORKERS = [f"worker-{i}" for i in range(8)]


class Rig:
    """A one-table store (two chunks of 3 floats, SGD with lr 1, weights 0) and an applier."""

    def __init__(self, spec: str, lr: float = 1.0, rule: str = "sgd") -> None:
        self.store = DenseStore()
        self.store.init("m", {"rule": rule, "lr": lr}, [(0, 0, 3), (1, 3, 3)],
                        [np.zeros(3, F32), np.zeros(3, F32)])
        self.stats = ServerStats()
        #: The factor each update was applied with (the rule's step is lr times it).
        self.scales: list[float] = []
        inline = InlineUpdates(self.stats)
        recorded = self.scales

        class Recording:
            def run(self, table, chunk, grad, scale, ticket, rule=None, tags=()) -> None:  # type: ignore[no-untyped-def]
                recorded.append(scale)
                inline.run(table, chunk, grad, scale, ticket, rule, tags)

        self.applier = UpdateApplier(parse_policy(spec), self.stats, Recording())

    @property
    def table(self) -> DenseTable:
        return self.store.table("m")

    def chunk(self, chunk_id: int = 0) -> DenseChunk:
        return self.table.chunks[chunk_id]

    def push(self, sender: str, grad: float | np.ndarray, live, pulled: int | None = None,
             chunk_id: int = 0, known: bool = True) -> int | None:
        """Push one gradient to one chunk (by default pulled at the chunk's current version);
        returns its staleness."""
        chunk = self.chunk(chunk_id)
        g = np.full(3, grad, F32) if np.isscalar(grad) else np.asarray(grad, F32)
        version = chunk.version if pulled is None else pulled
        (staleness,) = self.applier.push(self.table, [chunk], [g], [version], sender, set(live),
                                         known)
        return staleness

    def weights(self, chunk_id: int = 0) -> list[float]:
        return self.chunk(chunk_id).weights.tolist()

    def version(self, chunk_id: int = 0) -> int:
        return self.chunk(chunk_id).version


# ---------------------------------------------------------------------------------------------
# async
# ---------------------------------------------------------------------------------------------


def test_async_applies_every_gradient_at_once() -> None:
    rig = Rig("async")
    assert rig.push("worker-0", 1.0, WORKERS) == 0
    assert rig.version() == 1 and rig.weights() == [-1.0] * 3
    assert rig.push("worker-1", 2.0, WORKERS, pulled=0) == 1  # pulled before the first update
    assert rig.version() == 2 and rig.weights() == [-3.0] * 3
    assert rig.stats.updates == 2
    assert dict(rig.stats.staleness) == {0: 1, 1: 1}
    assert not rig.applier.waiting_on("worker-0", "m", [0, 1])


def test_staleness_is_never_negative() -> None:
    """A pulled version ahead of the chunk (a restarted server) counts as staleness 0."""
    rig = Rig("async")
    assert rig.push("worker-0", 1.0, WORKERS, pulled=5) == 0


# ---------------------------------------------------------------------------------------------
# softsync:n
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "live", "c"), [
    (1, 8, 8), (2, 8, 4), (4, 8, 2), (8, 8, 1), (3, 8, 2), (16, 8, 1), (2, 1, 1), (2, 3, 1),
])
def test_softsync_group_size_is_floor_lambda_over_n(n: int, live: int, c: int) -> None:
    assert parse_policy(f"softsync:{n}").group_size(live) == c
    rig = Rig(f"softsync:{n}")
    for i in range(c - 1):
        rig.push(WORKERS[i], 1.0, WORKERS[:live])
        assert rig.version() == 0, f"applied after {i + 1} of {c} gradients"
    rig.push(WORKERS[c - 1], 1.0, WORKERS[:live])
    assert rig.version() == 1
    assert rig.stats.updates == 1


def test_softsync_applies_the_mean_of_the_group() -> None:
    rig = Rig("softsync:2")  # 8 live: c = 4
    for i, g in enumerate([1.0, 2.0, 3.0, 6.0]):
        rig.push(WORKERS[i], g, WORKERS)
    assert rig.weights() == [-3.0] * 3  # mean 3, lr 1, applied once
    assert rig.version() == 1


def test_softsync_group_takes_any_workers_even_the_same_one_twice() -> None:
    """Rudra's softsync counts gradients, not workers: a fast worker may fill a group alone."""
    rig = Rig("softsync:4")  # 8 live: c = 2
    rig.push("worker-0", 1.0, WORKERS)
    rig.push("worker-0", 3.0, WORKERS)
    assert rig.version() == 1 and rig.weights() == [-2.0] * 3


def test_softsync_staleness_is_measured_on_arrival_and_applies_at_group_boundaries() -> None:
    rig = Rig("softsync:4")  # c = 2
    assert rig.push("worker-0", 1.0, WORKERS, pulled=0) == 0
    assert rig.push("worker-1", 1.0, WORKERS, pulled=0) == 0  # version still 0: same group
    assert rig.push("worker-2", 1.0, WORKERS, pulled=0) == 1
    assert rig.push("worker-3", 1.0, WORKERS, pulled=0) == 1
    assert rig.version() == 2


def test_softsync_lambda_shrinks_mid_group() -> None:
    """Workers die: lambda 8 -> 4 makes c 4 -> 2, and a group already holding 3 is applied on
    the membership change, as far as 3 of a full group of 4 move the weights."""
    rig = Rig("softsync:2")
    for i in range(3):
        rig.push(WORKERS[i], float(i + 1), WORKERS)
    assert rig.version() == 0
    assert rig.applier.complete_groups(set(WORKERS[:4])) == 1
    assert rig.version() == 1 and rig.weights() == [-1.5] * 3  # (1 + 2 + 3) / 4


def test_softsync_lambda_grows_mid_group() -> None:
    """Workers join: lambda 4 -> 8 makes c 2 -> 4, so the open group waits for more."""
    rig = Rig("softsync:2")
    rig.push("worker-0", 1.0, WORKERS[:4])
    assert rig.applier.complete_groups(set(WORKERS)) == 0
    rig.push("worker-1", 1.0, WORKERS)
    rig.push("worker-2", 1.0, WORKERS)
    assert rig.version() == 0
    rig.push("worker-3", 1.0, WORKERS)
    assert rig.version() == 1


def test_groups_do_not_close_while_membership_is_unknown() -> None:
    """A push from a sender the server does not know yet waits for the scheduler's view."""
    live = ["worker-0", "worker-1", "worker-2", "worker-9"]
    rig = Rig("softsync:2")  # 4 live: c = 2, but only once the membership is known
    for g in (1.0, 2.0, 3.0):
        rig.push("worker-9", g, live, known=False)
    assert rig.version() == 0
    assert rig.applier.complete_groups(set(live)) == 1
    assert rig.version() == 1 and rig.weights() == [-2.0] * 3  # the mean of all three


def test_groups_are_per_chunk() -> None:
    rig = Rig("softsync:4")  # c = 2
    rig.push("worker-0", 1.0, WORKERS, chunk_id=0)
    rig.push("worker-1", 1.0, WORKERS, chunk_id=1)
    assert (rig.version(0), rig.version(1)) == (0, 0)
    rig.push("worker-1", 1.0, WORKERS, chunk_id=0)
    assert (rig.version(0), rig.version(1)) == (1, 0)


# ---------------------------------------------------------------------------------------------
# hardsync
# ---------------------------------------------------------------------------------------------


def test_hardsync_waits_for_every_live_worker() -> None:
    live = WORKERS[:3]
    rig = Rig("hardsync")
    rig.push("worker-0", 3.0, live)
    rig.push("worker-1", 6.0, live)
    assert rig.version() == 0
    assert rig.applier.waiting_on("worker-0", "m", [0])
    assert rig.applier.waiting_on("worker-1", "m", [1, 0])
    assert not rig.applier.waiting_on("worker-2", "m", [0])
    assert not rig.applier.waiting_on("worker-0", "m", [1])  # nothing pushed to chunk 1
    rig.push("worker-2", 0.0, live)
    assert rig.version() == 1 and rig.weights() == [-3.0] * 3
    assert not any(rig.applier.waiting_on(w, "m", [0]) for w in live)
    assert dict(rig.stats.staleness) == {0: 3}


def test_hardsync_with_one_worker_applies_each_push() -> None:
    rig = Rig("hardsync")
    rig.push("worker-0", 1.0, ["worker-0"])
    assert rig.version() == 1
    assert not rig.applier.waiting_on("worker-0", "m", [0])


def test_hardsync_duplicate_push_is_refused_and_changes_nothing() -> None:
    live = WORKERS[:2]
    rig = Rig("hardsync")
    rig.push("worker-0", 1.0, live)
    chunk0, chunk1 = rig.chunk(0), rig.chunk(1)
    grads = [np.ones(3, F32), np.ones(3, F32)]
    with pytest.raises(ConflictError, match="already pushed"):
        # chunk 1 is new for worker-0 but chunk 0 is not: the whole push is refused
        rig.applier.push(rig.table, [chunk1, chunk0], grads, [0, 0], "worker-0", set(live))
    assert not rig.applier.waiting_on("worker-0", "m", [1])
    assert sum(rig.stats.staleness.values()) == 1
    rig.push("worker-1", 3.0, live)
    assert rig.weights() == [-2.0] * 3  # the refused gradient is not in the mean


def test_hardsync_death_mid_step_applies_the_open_step() -> None:
    """worker-2 dies before pushing: the live set shrinks and the step closes without it."""
    live = WORKERS[:3]
    rig = Rig("hardsync")
    rig.push("worker-0", 1.0, live)
    rig.push("worker-1", 3.0, live)
    assert rig.applier.complete_groups(set(live)) == 0
    assert rig.applier.complete_groups({"worker-0", "worker-1"}) == 1
    assert rig.version() == 1 and rig.weights() == pytest.approx([-4.0 / 3] * 3)  # (1 + 3) / 3
    assert not rig.applier.waiting_on("worker-0", "m", [0])


def test_hardsync_death_after_pushing_keeps_its_gradient() -> None:
    """A worker that pushed and then died: its gradient stays in the mean, the others close
    the step."""
    rig = Rig("hardsync")
    rig.push("worker-0", 6.0, WORKERS[:3])
    rig.push("worker-1", 0.0, ["worker-1", "worker-2"])  # worker-0 is gone
    assert rig.version() == 0  # worker-2 is still live
    rig.push("worker-2", 0.0, ["worker-1", "worker-2"])
    assert rig.version() == 1 and rig.weights() == [-2.0] * 3


def test_a_job_tail_never_steps_further_than_a_full_group() -> None:
    """softsync:1 at lambda 4: full groups move by their mean; as learners leave, each short
    group moves by its sum over 4, down to the last learner's gradients alone (a quarter step
    each, not a full one)."""
    rig = Rig("softsync:1")
    live = WORKERS[:4]
    for w in live:
        rig.push(w, 4.0, live)
    assert rig.version() == 1 and rig.weights() == [-4.0] * 3  # a full group: the mean
    for w in live[:2]:
        rig.push(w, 4.0, live[:2])  # two learners left: c = 2
    assert rig.version() == 2 and rig.weights() == [-6.0] * 3  # 2 of 4: half the step
    rig.push("worker-0", 4.0, ["worker-0"])  # the last learner alone
    assert rig.version() == 3 and rig.weights() == [-7.0] * 3  # a quarter step
    assert rig.applier.full_group == 4


@pytest.mark.parametrize("spec", ["softsync:1+lr=mean", "softsync:1+lr=staleness",
                                  "hardsync+lr=staleness"])
def test_a_short_group_is_scaled_under_the_rate_modifiers_too(spec: str) -> None:
    """The modifiers' factors and the short group's factor multiply: with staleness 0 both
    modifiers give 1, and a group of 1 of a full 4 moves a quarter of the gradient."""
    rig = Rig(spec)
    for w in WORKERS[:4]:
        rig.push(w, 4.0, WORKERS[:4])
    rig.push("worker-0", 4.0, ["worker-0"])
    assert rig.weights() == [-5.0] * 3


def test_a_leaving_learner_under_async_changes_nothing() -> None:
    """Groups of one stay groups of one: async's steps do not shrink as learners leave."""
    rig = Rig("async")
    rig.push("worker-0", 1.0, WORKERS)
    rig.push("worker-0", 1.0, ["worker-0"])
    assert rig.weights() == [-2.0] * 3 and rig.applier.full_group == 1


def test_softsync_tail_of_groups_of_one_is_scaled_by_the_full_group() -> None:
    """softsync:2 at lambda 4 (c = 2): once one learner is left c = 1, and each of its
    gradients, applied at once, moves half as far as in a group of 2."""
    rig = Rig("softsync:2")
    rig.push("worker-0", 2.0, WORKERS[:4])
    rig.push("worker-1", 2.0, WORKERS[:4])
    assert rig.weights() == [-2.0] * 3
    rig.push("worker-0", 2.0, ["worker-0"])
    assert rig.version() == 2 and rig.weights() == [-3.0] * 3


def test_hardsync_join_mid_step_waits_for_the_newcomer() -> None:
    """worker-2 joins while a step is open: the step now needs its gradient too."""
    rig = Rig("hardsync")
    rig.push("worker-0", 1.0, ["worker-0", "worker-1"])
    assert rig.applier.complete_groups({"worker-0", "worker-1", "worker-2"}) == 0
    rig.push("worker-1", 1.0, ["worker-0", "worker-1", "worker-2"])
    assert rig.version() == 0
    # The newcomer is not held back (it has nothing in the step), pulls version 0, pushes.
    assert not rig.applier.waiting_on("worker-2", "m", [0])
    assert rig.push("worker-2", 4.0, WORKERS[:3]) == 0
    assert rig.version() == 1 and rig.weights() == [-2.0] * 3


def test_hardsync_every_step_has_staleness_zero() -> None:
    rig = Rig("hardsync")
    live = WORKERS[:4]
    for _ in range(5):
        pulled = rig.version()
        for worker in live:
            assert rig.push(worker, 1.0, live, pulled=pulled) == 0
    assert rig.version() == 5
    assert dict(rig.stats.staleness) == {0: 20}


# ---------------------------------------------------------------------------------------------
# modifiers
# ---------------------------------------------------------------------------------------------


def test_maxstale_drops_and_counts() -> None:
    rig = Rig("async+maxstale=2")
    for _ in range(3):
        rig.push("worker-0", 1.0, WORKERS)
    assert rig.version() == 3
    assert rig.push("worker-1", 1.0, WORKERS, pulled=1) == 2  # staleness 2: accepted
    assert rig.push("worker-1", 5.0, WORKERS, pulled=1) is None  # staleness 3: dropped
    assert rig.version() == 4 and rig.weights() == [-4.0] * 3
    assert rig.stats.dropped == 1
    assert sum(rig.stats.staleness.values()) == 4  # the dropped one is not in the histogram


def test_maxstale_zero_with_hardsync_never_deadlocks() -> None:
    """A dropped gradient leaves its sender out of the step, so it may pull and push again."""
    rig = Rig("hardsync+maxstale=0")
    live = ["worker-0", "worker-1"]
    rig.push("worker-0", 1.0, live)
    assert rig.push("worker-1", 1.0, live, pulled=0) == 0
    assert rig.version() == 1
    assert rig.push("worker-0", 1.0, live, pulled=0) is None  # stale: dropped
    assert not rig.applier.waiting_on("worker-0", "m", [0])
    rig.push("worker-0", 1.0, live)
    rig.push("worker-1", 1.0, live)
    assert rig.version() == 2


@pytest.mark.parametrize(("staleness", "step"), [(0, 1.0), (1, 1.0), (2, 0.5), (4, 0.25)])
def test_lr_staleness_scales_the_step(staleness: int, step: float) -> None:
    rig = Rig("async+lr=staleness")
    for _ in range(staleness):
        rig.push("worker-0", 0.0, WORKERS)
    before = rig.weights()
    assert rig.push("worker-1", 1.0, WORKERS, pulled=0) == staleness
    assert np.allclose(np.subtract(before, rig.weights()), step)


def test_lr_staleness_scales_each_gradient_in_a_group() -> None:
    rig = Rig("softsync:4+lr=staleness")  # c = 2
    rig.push("worker-0", 1.0, WORKERS)
    rig.push("worker-1", 1.0, WORKERS)  # version 1 now
    rig.push("worker-2", 2.0, WORKERS)  # staleness 0 -> scale 1
    rig.push("worker-3", 8.0, WORKERS, pulled=0)  # staleness 1 -> scale 1
    rig.push("worker-4", 4.0, WORKERS, pulled=0)  # staleness 2 -> scale 1/2
    rig.push("worker-5", 8.0, WORKERS, pulled=0)  # staleness 2 -> scale 1/2
    # -1 (first group) -5 (mean of 2, 8) -3 (mean of 2, 4)
    assert rig.version() == 3 and np.allclose(rig.weights(), -9.0)


def test_lr_mean_scales_every_gradient_by_the_running_mean_staleness() -> None:
    rig = Rig("async+lr=mean")
    rig.push("worker-0", 1.0, WORKERS)  # staleness 0, mean 0: full step
    assert np.allclose(rig.weights(), -1.0)
    rig.push("worker-0", 0.0, WORKERS)
    rig.push("worker-0", 0.0, WORKERS)  # version 3, staleness so far 0, 0, 0
    assert rig.push("worker-1", 1.0, WORKERS, pulled=0) == 3  # mean (0+0+0+3)/4 < 1: step 1
    assert np.allclose(rig.weights(), -2.0)
    assert rig.push("worker-1", 1.0, WORKERS, pulled=0) == 4  # mean 7/5 = 1.4
    assert np.allclose(rig.weights(), -2.0 - 1 / 1.4)
    before = rig.weights()
    assert rig.push("worker-2", 1.0, WORKERS) == 0  # a fresh gradient: mean 7/6, scaled too
    assert np.allclose(np.subtract(before, rig.weights()), 6 / 7)


@pytest.mark.parametrize(("rule", "scale"), [("sgd", 0.25), ("momentum", 0.25), ("adam", 0.5),
                                             ("adamw", 0.5), ("adagrad", 0.5), ("rmsprop", 0.5)])
def test_lr_mean_takes_the_rules_law(rule: str, scale: float) -> None:
    """Nine gradients pulled at version 0 have staleness 0..8, mean 4: sgd and momentum divide
    the ninth's step by 4, the adaptive rules by sqrt(4)."""
    rig = Rig("async+lr=mean", lr=0.01, rule=rule)
    for staleness in range(9):
        assert rig.push("worker-1", 1.0, WORKERS, pulled=0) == staleness
    assert rig.scales[-1] == pytest.approx(scale)


def test_lr_mean_logs_its_law_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="hogshard.ps.applier")
    for _ in range(2):  # two servers in one process (the simulator): one line
        rig = Rig("softsync:7+lr=mean", lr=0.01, rule="rmsprop")
        rig.push("worker-0", 1.0, WORKERS)
    lines = [r.getMessage() for r in caplog.records if "+lr=mean under rmsprop" in r.getMessage()]
    assert len(lines) == 1 and "sqrt(<staleness>)" in lines[0]


def test_lr_staleness_in_a_tail_counts_at_least_the_mean_staleness() -> None:
    """While fewer learners are live than the most seen, a fresh gradient under +lr=staleness
    takes no more than the running mean's factor; with all of them back, its full step."""
    rig = Rig("async+lr=staleness")
    for staleness in range(7):  # staleness 0..6 with 4 live: sum 21
        assert rig.push("worker-1", 0.0, WORKERS[:4], pulled=0) == staleness
    assert rig.scales == [1.0, 1.0] + [1 / s for s in range(2, 7)]
    assert rig.push("worker-0", 1.0, WORKERS[:2]) == 0  # two left: mean 21 / 8
    assert rig.scales[-1] == pytest.approx(8 / 21)
    assert rig.push("worker-0", 1.0, WORKERS[:4]) == 0  # all four live again
    assert rig.scales[-1] == 1.0


def test_lr_mean_restarts_when_the_policy_changes() -> None:
    rig = Rig("async+lr=mean")
    for _ in range(4):
        rig.push("worker-0", 0.0, WORKERS)
    rig.push("worker-1", 0.0, WORKERS, pulled=0)  # staleness 4: mean 0.8
    rig.push("worker-1", 0.0, WORKERS, pulled=0)  # staleness 5: mean 1.5
    rig.applier.switch(parse_policy("softsync:8+lr=mean"))
    before = rig.weights()
    rig.push("worker-2", 1.0, WORKERS)  # the first gradient under the new policy: mean 0
    assert np.allclose(np.subtract(before, rig.weights()), 1.0)


def test_delay_compensation_matches_the_formula() -> None:
    """DC-ASGD: the applied gradient is g + lambda * g * g * (w_now - w_pulled)."""
    lam = 0.5
    rig = Rig(f"async+dc={lam}", lr=0.1)
    w_pulled = rig.chunk().weights.copy()
    rig.applier.remember_pull("worker-1", "m", 0, w_pulled)
    rig.push("worker-0", [1.0, -2.0, 3.0], WORKERS)  # moves w to (-0.1, 0.2, -0.3)
    w_now = rig.chunk().weights.copy()
    g = np.array([2.0, 1.0, -4.0], F32)
    rig.push("worker-1", g, WORKERS, pulled=0)
    expected = w_now - 0.1 * (g + lam * g * g * (w_now - w_pulled))
    # by hand: compensated g = (2 + .5*4*-.1, 1 + .5*1*.2, -4 + .5*16*-.3) = (1.8, 1.1, -6.4)
    assert np.allclose(expected, [-0.1 - 0.18, 0.2 - 0.11, -0.3 + 0.64])
    assert np.allclose(rig.weights(), expected, atol=1e-6)


def test_delay_compensation_without_a_remembered_pull_is_plain() -> None:
    rig = Rig("async+dc=2")
    rig.push("worker-0", 1.0, WORKERS)
    assert rig.weights() == [-1.0] * 3


def test_remember_pull_keeps_nothing_without_dc() -> None:
    rig = Rig("async")
    rig.applier.remember_pull("worker-0", "m", 0, np.ones(3, F32))
    assert rig.applier._pulled == {}


# ---------------------------------------------------------------------------------------------
# switching policy
# ---------------------------------------------------------------------------------------------


def test_switch_flushes_open_groups() -> None:
    rig = Rig("softsync:2")  # c = 4
    rig.push("worker-0", 1.0, WORKERS, chunk_id=0)
    rig.push("worker-1", 3.0, WORKERS, chunk_id=0)
    rig.push("worker-0", 5.0, WORKERS, chunk_id=1)
    rig.applier.switch(parse_policy("async"))
    assert (rig.version(0), rig.version(1)) == (1, 1)
    # short groups, each as far as its gradients would move a full group of 4
    assert rig.weights(0) == [-1.0] * 3 and rig.weights(1) == [-1.25] * 3
    rig.push("worker-2", 1.0, WORKERS)  # now async
    assert rig.version(0) == 2
    assert rig.applier.complete_groups(set(WORKERS)) == 0  # nothing left open


def test_switch_from_hardsync_releases_the_waiting_workers() -> None:
    rig = Rig("hardsync")
    rig.push("worker-0", 1.0, WORKERS[:2])
    assert rig.applier.waiting_on("worker-0", "m", [0])
    rig.applier.switch(parse_policy("softsync:1"))
    assert not rig.applier.waiting_on("worker-0", "m", [0])
    assert rig.version() == 1


def test_switch_to_hardsync_starts_with_empty_steps() -> None:
    rig = Rig("async")
    rig.push("worker-0", 1.0, WORKERS[:2])
    rig.applier.switch(parse_policy("hardsync"))
    rig.push("worker-0", 1.0, WORKERS[:2])
    assert rig.version() == 1 and rig.applier.waiting_on("worker-0", "m", [0])


def test_switch_away_from_dc_forgets_pulled_weights() -> None:
    rig = Rig("async+dc=1")
    rig.applier.remember_pull("worker-0", "m", 0, np.ones(3, F32))
    rig.applier.switch(parse_policy("async+dc=2"))
    assert rig.applier._pulled
    rig.applier.switch(parse_policy("async"))
    assert rig.applier._pulled == {}


# ---------------------------------------------------------------------------------------------
# the SSP read gate as the server applies it (live clocks from the scheduler + pushes seen)
# ---------------------------------------------------------------------------------------------


class Gate:
    """The pull gate as the dense ops apply it: a gradient of the sender waiting in an open
    step (the applier), then the policy over the live workers' clocks (the worker view)."""

    def __init__(self, spec: str, live: dict[str, int],
                 observed: dict[str, int] | None = None) -> None:
        self.rig = Rig(spec)
        self.view = WorkerView()
        self.view.listed(live, asked_at=0.0)
        for worker, clock in (observed or {}).items():
            self.view.pulled(worker, clock)

    def allows(self, sender: str, clock: int | None) -> bool:
        applier = self.rig.applier
        return not applier.waiting_on(sender, "m", [0]) and \
            self.view.may_pull(applier.policy, sender, clock)


def test_ssp_gate_uses_the_slowest_live_worker() -> None:
    gate = Gate("ssp:2", {"worker-0": 5, "worker-1": 3})
    assert gate.allows("worker-0", 5)
    assert not gate.allows("worker-0", 6)


def test_ssp_gate_takes_pushes_seen_over_stale_heartbeats() -> None:
    """The scheduler's clocks lag a heartbeat; a request seen here moves the clock at once."""
    gate = Gate("ssp:0", {"worker-0": 4, "worker-1": 2}, observed={"worker-1": 4})
    assert gate.allows("worker-0", 4)
    assert not gate.allows("worker-0", 5)
    gate.view.pushed("worker-1", 4)  # its push of step 4 is in: it is at clock 5
    assert gate.allows("worker-0", 5)


def test_ssp_gate_ignores_dead_workers_it_has_seen() -> None:
    gate = Gate("ssp:1", {"worker-0": 9}, observed={"worker-1": 0})
    assert gate.allows("worker-0", 9)


def test_ssp_gate_counts_the_requester_even_if_not_yet_live() -> None:
    assert Gate("ssp:0", {}).allows("worker-5", 100)


def test_ssp_gate_lets_pulls_without_a_clock_through() -> None:
    assert Gate("ssp:0", {"worker-0": 0, "worker-1": 7}).allows("worker-1", None)


def test_hardsync_gate_holds_a_worker_with_a_gradient_in_the_open_step() -> None:
    gate = Gate("hardsync", {"worker-0": 1, "worker-1": 1})
    gate.rig.push("worker-0", 1.0, ["worker-0", "worker-1"])
    assert not gate.allows("worker-0", 1)
    assert gate.allows("worker-1", 1)


def test_ssp_gate_counts_a_newcomer_until_a_later_heartbeat_leaves_it_out() -> None:
    gate = Gate("ssp:0", {"worker-0": 3})
    assert gate.view.note("worker-0", now=1.0)
    assert not gate.view.note("worker-1", now=1.0)  # heard from before the scheduler listed it
    assert gate.view.live() == {"worker-0", "worker-1"}
    assert not gate.allows("worker-0", 3)  # held back by the newcomer at clock 0
    gate.view.listed({"worker-0": 3}, asked_at=0.5)  # a reply to a heartbeat sent before
    assert not gate.allows("worker-0", 3)
    gate.view.listed({"worker-0": 3}, asked_at=2.0)  # a later reply leaves it out
    assert gate.allows("worker-0", 3)


def test_a_worker_that_says_it_left_no_longer_holds_back_ssp() -> None:
    gate = Gate("ssp:0", {"worker-0": 3, "worker-1": 0})
    assert not gate.allows("worker-0", 3)  # waiting for worker-1
    gate.view.left("worker-1", now=1.0)
    assert gate.allows("worker-0", 3)
    gate.view.listed({"worker-0": 3, "worker-1": 0}, asked_at=0.5)  # asked before it left
    assert gate.allows("worker-0", 3)
    gate.view.listed({"worker-0": 3, "worker-1": 0}, asked_at=2.0)  # it came back
    assert not gate.allows("worker-0", 3)


def test_a_worker_that_says_it_left_completes_the_hardsync_step() -> None:
    gate = Gate("hardsync", {"worker-0": 1, "worker-1": 1})
    gate.rig.push("worker-0", 1.0, ["worker-0", "worker-1"])
    assert not gate.allows("worker-0", 1)  # its gradient waits for worker-1's
    gate.view.left("worker-1", now=1.0)
    assert gate.rig.applier.complete_groups(gate.view.live()) == 1
    assert gate.allows("worker-0", 1)  # the step was applied without it
    assert gate.rig.weights() == [-0.5, -0.5, -0.5]  # one gradient of a full step of two


@pytest.mark.parametrize("spec", ["async", "async+maxstale=1", "softsync:2", "ssp:1+lr=staleness"])
def test_staleness_predicts_what_push_returns(spec: str) -> None:
    """A push acknowledged before it is taken carries ``staleness``'s answer: the same list
    ``push`` returns, drops by ``+maxstale`` included."""
    rig = Rig(spec)
    pulled_at = [0, 0, 1, 3, 0, 2]
    for step, pulled in enumerate(pulled_at):
        chunks = [rig.chunk(0), rig.chunk(1)]
        versions = [min(pulled, c.version) for c in chunks]
        predicted = rig.applier.staleness(chunks, versions)
        sender = WORKERS[step % len(WORKERS)]
        taken = rig.applier.push(rig.table, chunks, [np.ones(3, F32)] * 2, versions, sender,
                                 set(WORKERS))
        assert predicted == taken
    if spec == "async+maxstale=1":
        assert rig.stats.dropped > 0  # the case the prediction must get right


def test_gradients_beyond_the_policy_bound_are_counted() -> None:
    """ssp:0 with 2 live workers promises staleness <= 1: a staler gradient is taken (ssp
    drops nothing) and counted."""
    rig = Rig("ssp:0")
    live = WORKERS[:2]
    for _ in range(3):
        rig.push("worker-0", 1.0, live)
    assert rig.push("worker-1", 1.0, live, pulled=2) == 1
    assert rig.stats.beyond_bound == 0
    assert rig.push("worker-1", 1.0, live, pulled=0) == 4
    assert rig.stats.beyond_bound == 1 and rig.stats.to_wire()["beyond_bound"] == 1
