"""Elastic workers with real processes, under every policy: a scheduler, 2 servers and
2 workers train; once they have made progress a third worker joins mid-job; once it trains, one
of the first two leaves cleanly (``client.close()``); the other two train on and finish.

Asserted for each of ``async``, ``ssp:1``, ``softsync:2``, ``softsync:1`` and ``hardsync``
(with 2 or 3 live workers ``softsync:2`` gathers groups of c = 1; ``softsync:1`` gathers
c = lambda, so its groups grow from 2 to 3 at the join and shrink back at the leave):

- the joiner is admitted: its register reply's clock is the slowest live worker's clock as the
  scheduler last heard it (between the slowest logged clock a little before it registered and
  the one just after), it trains from there (under ssp from the slowest clock the servers
  know, if higher) and exits 0;
- nobody deadlocks: after the joiner's first step every original worker completes steps, after
  the leave both remaining workers complete steps, and every worker exits 0;
- the leave is seen: the scheduler lists the leaver as ``done``;
- under ``hardsync`` every applied update averaged one gradient of every worker live at the
  time: staleness is 0 for every gradient (no group closed without a worker that had pulled its
  weights) and each chunk's version equals the rounds the workers' logs account for.

The workers are ``elastic_worker.py`` (numpy only, so a joiner starts in well under a second).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from hogshard.proto.transport import RpcChannel

PYTHON = sys.executable
WORKER = str(Path(__file__).with_name("elastic_worker.py"))
HEARTBEAT_S = 0.2
STEP_DELAY_S = "0.01"
MORE_STEPS = 3  # steps each remaining worker runs after the test says "finish"
WAIT_S = 20.0
#: How far back the scheduler's view of the clocks may lag (heartbeat interval, a reply, load).
CLOCK_LAG_S = 1.5


def events(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def steps(log: Path) -> list[dict[str, Any]]:
    return [e for e in events(log) if e["event"] == "step"]


def event(log: Path, name: str) -> dict[str, Any] | None:
    return next((e for e in events(log) if e["event"] == name), None)


def clock_at(log: Path, t: float) -> int:
    """The last clock the worker logged at or before ``t`` (its start clock before any step)."""
    clock = event(log, "joined")["clock"]
    for e in steps(log):
        if e["t"] <= t:
            clock = e["clock"]
    return clock


def stall_ms(log: Path, t: float) -> float:
    """The longest pause between two consecutive steps of a worker around ``t`` (from its last
    step before ``t`` to its first after, and on to the next): what a join or leave cost it."""
    times = [e["t"] for e in steps(log)]
    later = [i for i, x in enumerate(times) if x > t]
    if not later:
        return float("nan")
    i = later[0]
    gaps = [times[j] - times[j - 1] for j in range(max(1, i), min(len(times), i + 2))]
    return 1000 * max(gaps, default=float("nan"))


def server_stats(cluster: Any, zmq_ctx: Any) -> list[dict[str, Any]]:
    replies = []
    for member in cluster.members("server"):
        channel = RpcChannel(zmq_ctx, member["address"], sender="test")
        try:
            replies.append(channel.call("stats", timeout=5.0).header)
        finally:
            channel.close()
    return replies


@pytest.mark.integration
@pytest.mark.timeout(40, method="signal")
@pytest.mark.parametrize("policy", ["async", "ssp:1", "softsync:2", "softsync:1", "hardsync"])
def test_worker_joins_and_another_leaves_mid_job(procs, cluster_factory, zmq_ctx,
                                                 tmp_path: Path, policy: str) -> None:
    cluster = cluster_factory(servers=2, policy=policy, heartbeat_interval=HEARTBEAT_S)
    leave, finish = tmp_path / "leave", tmp_path / "finish"
    logs = [tmp_path / f"worker{rank}.jsonl" for rank in range(3)]

    def start(rank: int, stop: Path, more: int, *extra: str) -> Any:
        env = {"HOGSHARD_SCHEDULER": cluster.address, "HOGSHARD_RANK": str(rank),
               "HOGSHARD_NUM_WORKERS": "2", "HOGSHARD_REQUEST_TIMEOUT": str(WAIT_S)}
        return procs.spawn(f"worker{rank}", [PYTHON, WORKER, "--log", str(logs[rank]),
                                             "--stop-file", str(stop), "--more-steps", str(more),
                                             "--step-delay", STEP_DELAY_S, *extra], env=env)

    def progressed(rank: int, count: int, after: float = 0.0) -> bool:
        return sum(e["t"] > after for e in steps(logs[rank])) >= count

    leaver = start(0, leave, 0, "--start-barrier", "start")
    stayer = start(1, finish, MORE_STEPS, "--start-barrier", "start")
    procs.wait_until(lambda: progressed(0, 5) and progressed(1, 5), WAIT_S,
                     "the first two workers to train 5 steps", on_timeout=procs.report)

    joiner = start(2, finish, MORE_STEPS)
    procs.wait_until(lambda: progressed(2, 5), WAIT_S, "the joiner to train 5 steps",
                     on_timeout=procs.report)
    joined = event(logs[2], "joined")
    first_step = steps(logs[2])[0]["t"]
    procs.wait_until(lambda: progressed(0, 2, first_step) and progressed(1, 2, first_step),
                     WAIT_S, "the first workers to step on after the join",
                     on_timeout=procs.report)

    leave.touch()
    assert leaver.wait(WAIT_S) == 0, leaver.tail()
    left = event(logs[0], "left")
    assert left is not None, leaver.tail()
    assert cluster.member("worker-0")["state"] == "done", cluster.members("worker")
    procs.wait_until(lambda: progressed(1, 3, left["t"]) and progressed(2, 3, left["t"]),
                     WAIT_S, "the remaining workers to step on after the leave",
                     on_timeout=procs.report)
    finish.touch()
    for proc in (stayer, joiner):
        assert proc.wait(WAIT_S) == 0, proc.tail()
    members = {m["node_id"]: m["state"] for m in cluster.members("worker")}
    assert members == {"worker-0": "done", "worker-1": "done", "worker-2": "done"}, members

    # (a) the joiner got the slowest live clock the scheduler knew of, and trained from it
    slowest_before = min(clock_at(logs[r], joined["t_before"] - CLOCK_LAG_S) for r in (0, 1))
    slowest_after = min(clock_at(logs[r], joined["t"]) for r in (0, 1))
    # +1: a worker reports clock c + 1 in heartbeats between its push and its logged pull
    assert slowest_before <= joined["clock"] <= slowest_after + 1, (
        f"joiner's clock {joined['clock']}; slowest logged clock {slowest_before} "
        f"{CLOCK_LAG_S} s before it registered, {slowest_after} after")
    # it trains on from there: under ssp the servers may admit it at the slowest live clock
    # they know, above the scheduler's (its first pull's reply says so); else from that clock
    joiner_clocks = [e["clock"] for e in steps(logs[2])]
    start = joiner_clocks[0] - 1
    assert start == joined["clock"] or (policy.startswith("ssp") and start > joined["clock"]), \
        (joined["clock"], joiner_clocks[:3])
    assert joiner_clocks == list(range(start + 1, start + 1 + len(joiner_clocks))), joiner_clocks
    assert len(joiner_clocks) >= 5 + 3 + MORE_STEPS - 1

    stats = server_stats(cluster, zmq_ctx)
    histogram: dict[int, int] = {}
    for reply in stats:
        for value, count in reply["stats"]["staleness"]:
            histogram[value] = histogram.get(value, 0) + count
    # one line per policy for benchmarks/RESULTS.md (shown with pytest -s)
    print(f"\nELASTIC policy={policy} join_clock={joined['clock']} "
          f"slowest_at_join={slowest_after} "
          f"join_to_first_step_ms={1000 * (first_step - joined['t']):.0f} "
          f"stall_at_join_ms={max(stall_ms(logs[r], first_step) for r in (0, 1)):.0f} "
          f"leave_clock={left['clock']} "
          f"stall_at_leave_ms={max(stall_ms(logs[r], left['t']) for r in (1, 2)):.0f} "
          f"steps={[len(steps(log)) for log in logs]} staleness={sorted(histogram.items())}")
    assert all(not r["stats"]["errors"] for r in stats), [r["stats"]["errors"] for r in stats]
    # every step of every worker pushed once to each server, one gradient per chunk
    total_steps = sum(len(steps(log)) for log in logs)
    chunks = sum(len(t["chunks"]) for r in stats for t in r["tables"].values())
    assert sum(r["stats"]["pushes"] for r in stats) == len(stats) * total_steps, stats
    assert sum(histogram.values()) == chunks * total_steps, histogram
    if policy == "hardsync":
        # (d) no group closed without a live worker that had pulled: staleness 0 for every
        # gradient, the joiner's first included (it joins the step open when it pulls; the
        # start barrier answers once every server counts both first workers again)
        assert set(histogram) == {0}, f"hardsync staleness must be 0; got {histogram}"
        # and each worker's gradients went to consecutive rounds from the version it first
        # pulled, so every chunk's version is the last round any worker pushed to
        first = {r: dict(event(logs[r], "pulled")["versions"]) for r in range(3)}
        counts = {r: len(steps(logs[r])) for r in range(3)}
        versions = {c: v for r in stats for name, t in r["tables"].items() if name == "model"
                    for c, v in zip(t["chunks"], t["versions"], strict=True)}
        for chunk, version in versions.items():
            rounds = max(first[r][chunk] + counts[r] for r in range(3))
            assert version == rounds, (chunk, version, first, counts)
        # the joiner was admitted at the round the others were at, not at the start
        assert all(v > 0 for v in first[2].values()), first[2]
