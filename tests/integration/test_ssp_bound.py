"""SSP's staleness bound with real processes, at the edges of a job (docs/POLICIES.md,
"Staleness bounds"): under ``ssp:1`` a fast and a slow worker train; a third worker joins
mid-job, is SIGKILLed, declared dead and restarted under its rank. Every gradient every server
applied stays within (lambda - 1)(2S + 1) and none is counted beyond the bound.

The workers are ``elastic_worker.py`` (numpy only: a joiner starts in well under a second).
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from hogshard.proto.policy import parse_policy
from hogshard.proto.transport import RpcChannel

PYTHON = sys.executable
WORKER = str(Path(__file__).with_name("elastic_worker.py"))
HEARTBEAT_S = 0.2
HEARTBEAT_TIMEOUT_S = 1.0
WAIT_S = 30.0
POLICY = "ssp:1"


def steps(log: Path) -> int:
    if not log.exists():
        return 0
    return sum(json.loads(line)["event"] == "step" for line in log.read_text().splitlines())


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
@pytest.mark.timeout(90, method="signal")
def test_ssp_bound_holds_with_a_slow_worker_a_joiner_and_a_rejoin(
        procs, cluster_factory, zmq_ctx, tmp_path: Path) -> None:
    cluster = cluster_factory(servers=2, policy=POLICY, heartbeat_interval=HEARTBEAT_S,
                              heartbeat_timeout=HEARTBEAT_TIMEOUT_S)
    finish = tmp_path / "finish"

    def start(rank: int, log: Path, delay: str, *extra: str) -> Any:
        env = {"HOGSHARD_SCHEDULER": cluster.address, "HOGSHARD_RANK": str(rank),
               "HOGSHARD_NUM_WORKERS": "2", "HOGSHARD_REQUEST_TIMEOUT": str(WAIT_S)}
        return procs.spawn(f"worker{rank}-{log.stem}", [
            PYTHON, WORKER, "--log", str(log), "--stop-file", str(finish), "--more-steps", "3",
            "--step-delay", delay, *extra], env=env)

    def progressed(log: Path, count: int) -> bool:
        return steps(log) >= count

    logs = {name: tmp_path / f"{name}.jsonl" for name in ("fast", "slow", "joiner", "rejoin")}
    fast = start(0, logs["fast"], "0.002", "--start-barrier", "start")
    slow = start(1, logs["slow"], "0.03", "--start-barrier", "start")  # the others wait for it
    procs.wait_until(lambda: progressed(logs["fast"], 10) and progressed(logs["slow"], 10),
                     WAIT_S, "the first two workers to train 10 steps", on_timeout=procs.report)

    joiner = start(2, logs["joiner"], "0.002")
    procs.wait_until(lambda: progressed(logs["joiner"], 10), WAIT_S,
                     "the joiner to train 10 steps", on_timeout=procs.report)
    joiner.signal_group(signal.SIGKILL)
    assert joiner.wait(10.0) == -signal.SIGKILL

    def dead() -> bool:
        member = cluster.member("worker-2")
        return member is not None and member["state"] == "dead"

    procs.wait_until(dead, WAIT_S, "the scheduler to declare worker-2 dead",
                     on_timeout=procs.report)
    rejoined = start(2, logs["rejoin"], "0.002")
    procs.wait_until(lambda: progressed(logs["rejoin"], 10), WAIT_S,
                     "the restarted worker-2 to train 10 steps", on_timeout=procs.report)
    finish.touch()
    for proc in (fast, slow, rejoined):
        assert proc.wait(WAIT_S) == 0, proc.tail()

    stats = server_stats(cluster, zmq_ctx)
    histogram: dict[int, int] = {}
    for reply in stats:
        for value, count in reply["stats"]["staleness"]:
            histogram[value] = histogram.get(value, 0) + count
    bound = parse_policy(POLICY).staleness_bound(3)
    print(f"\nSSP_BOUND policy={POLICY} bound={bound} staleness={sorted(histogram.items())} "
          f"steps={[steps(log) for log in logs.values()]}")
    assert bound == 6
    assert max(histogram) <= bound, histogram
    assert [r["stats"]["beyond_bound"] for r in stats] == [0] * len(stats), histogram
    assert all(not r["stats"]["errors"] for r in stats), [r["stats"]["errors"] for r in stats]
