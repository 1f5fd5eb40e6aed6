"""A drained server's dense chunks move with its embedding slots while a worker keeps pushing
(``hogshard embeddings drain``): the weights, versions and Adam state of every chunk, in each
parameter group, end exactly where the same pushes take them in one process, and the drained
server can then be stopped."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hogshard.ps.dense import DenseTable
from tests.integration.test_resharding import Job

SIZE = 512
RULE = {"rule": "adam", "lr": 0.01, "groups": [{"start": 0, "lr": 0.01},
                                                {"start": 320, "lr": 0.002}]}


class DenseJob(Job):
    """A :class:`Job` whose every step also pushes a gradient of a two-group Adam table,
    applied to a reference in this process as well."""

    def __init__(self, procs: Any, tmp_path: Path, servers: int) -> None:
        super().__init__(procs, tmp_path, servers)
        init = np.linspace(-1, 1, SIZE, dtype=np.float32)
        self.dense = self.client.dense_table("a", SIZE, RULE, init=init, chunk_elems=64)
        self.reference = init.copy()
        self._local = DenseTable.from_spec("a", RULE)
        self._bounds = [(0, 320), (320, SIZE)]
        self._states = [self._local.rules.registered_for(start).new_state(end - start)
                        for start, end in self._bounds]
        self.dense_pushes = 0
        self.weights = np.empty(SIZE, np.float32)
        self.client.pull(self.dense, self.weights).result(60.0)

    def push(self, steps: int = 1) -> None:
        for _ in range(steps):
            super().push()
            grads = self.rng.standard_normal(SIZE).astype(np.float32)
            self.client.push(self.dense, grads).result(60.0)
            for (start, end), state in zip(self._bounds, self._states, strict=True):
                self._local.rules.registered_for(start).apply(
                    self.reference[start:end], grads[start:end], state, 1.0)
            self.dense_pushes += 1

    def pull_dense(self) -> np.ndarray:
        self.client.pull(self.dense, self.weights).result(60.0)
        return self.weights.copy()


def _chunks_moved(job: DenseJob, rank: int) -> dict[str, Any] | None:
    member = next(m for m in job.status()["members"] if m["node_id"] == f"server-{rank}")
    moved = (member.get("stats") or {}).get("chunks_moved")
    return moved if moved and moved["chunks_out"] else None


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
def test_a_drained_server_hands_over_its_dense_chunks_and_can_then_stop(
        procs, tmp_path: Path) -> None:
    job = DenseJob(procs, tmp_path, servers=3)
    try:
        held = [c.chunk_id for c in job.dense.chunks if c.server == 0]
        assert held, "server 0 holds no chunk of the dense table"
        job.push(10)
        pushed, output = job.change_while_pushing("drain", 0)
        assert pushed >= 1
        assert "server 0 holds no embedding slot and no dense chunk: it can be stopped" \
            in output, output
        placement = job.status()["embedding_slots"]
        assert "0" not in placement["dense"] and placement["chunks_moving"] == 0, placement
        assert placement["moves"][-1]["chunks"] == len(held), placement
        moved = procs.wait_until(lambda: _chunks_moved(job, 0), 10.0,
                                 "server 0's heartbeat to count the chunks it moved",
                                 on_timeout=procs.report)
        assert moved["chunks_out"] == len(held) and moved["bytes_out"] > 0, moved
        job.servers[0].signal_group(signal.SIGTERM)
        assert job.servers[0].wait(15.0) is not None
        procs.wait_until(lambda: not job.live(0), 10.0, "server 0 to be gone",
                         on_timeout=procs.report)
        job.push(10)  # served by servers 1 and 2 alone
        weights = job.pull_dense()
        rows = job.pull()
        owners = {c.chunk_id: c.server for c in job.dense.chunks}
        versions = dict(job.dense.pulled_versions)
    finally:
        job.close()
    np.testing.assert_array_equal(weights, job.reference)
    np.testing.assert_array_equal(rows, job.expected)
    assert all(owners[c] in (1, 2) for c in held), owners
    assert set(versions.values()) == {job.dense_pushes}, versions
