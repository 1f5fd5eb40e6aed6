"""A restarted scheduler rebuilds the shard map as servers re-register: a client that fetches
it half-built keeps its old placement (it used to adopt the partial one, and resending a
request for a chunk missing from it raised KeyError) and adopts the map once it is whole."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hogshard.proto.tables import Chunk, DenseTableSpec
from hogshard.worker.rerouting import REFRESH_EVERY_S, Rerouter
from hogshard.worker.tables import DenseHandle


class _Scheduler:
    """Answers ``get_table`` with whatever placement the test set."""

    def __init__(self, chunks: list[Chunk], epoch: int) -> None:
        self.chunks, self.epoch = chunks, epoch

    def call(self, op: str, fields: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert op == "get_table"
        return {"chunks": [c.to_wire() for c in self.chunks], "map_epoch": self.epoch,
                "servers": []}


def _channel(scheduler: _Scheduler) -> Any:
    return SimpleNamespace(node_id="worker-0", control=scheduler,
                           settings=SimpleNamespace(connect_timeout=1.0),
                           connect=lambda servers, holding=(): None,
                           book=SimpleNamespace(waiting=lambda: []))


def test_a_half_built_map_is_not_adopted() -> None:
    placed = [Chunk(0, 0, 10, 0, 1), Chunk(1, 10, 10, 1, 0)]
    table = DenseHandle(DenseTableSpec("model", 20, 10, {"name": "sgd"}), placed, replication=2)
    scheduler = _Scheduler([Chunk(1, 10, 10, 1, 0)], epoch=2)  # server 0 not back yet
    rerouter = Rerouter(_channel(scheduler))
    rerouter.track(table, map_epoch=1)
    rerouter.announced = 2

    rerouter.run(now=10.0)
    assert set(table.by_id) == {0, 1} and table.by_id[0].server == 0
    assert rerouter.map_epoch == 1  # not followed: it will be fetched again

    scheduler.chunks = [Chunk(0, 0, 10, 1, 0), Chunk(1, 10, 10, 1, 0)]
    rerouter.run(now=10.0 + 2 * REFRESH_EVERY_S)
    assert table.by_id[0].server == 1 and rerouter.map_epoch == 2
