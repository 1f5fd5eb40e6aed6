"""A push that closes a step on a server holding none of its chunks (``close``, an empty
request) belongs to that server: a map refresh that moves nothing leaves it waiting there
(it used to be re-sent to the owners of its no chunks, that is nowhere, and its step waited
for ever); a new process under the rank gets it again; a server gone ends it unanswered."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hogshard.proto.tables import Chunk, DenseTableSpec
from hogshard.worker.futures import PendingRequest
from hogshard.worker.rerouting import Rerouter, Route
from hogshard.worker.tables import DenseHandle

CHUNKS = [Chunk(0, 0, 10, 0), Chunk(1, 10, 10, 1)]


class _Channel(SimpleNamespace):
    """Two servers; the scheduler's map never moves, its membership epoch does."""

    def __init__(self, pending: PendingRequest) -> None:
        live = [{"rank": r, "address": f"tcp://s{r}"} for r in (0, 1)]
        super().__init__(
            node_id="worker-0", settings=SimpleNamespace(connect_timeout=1.0),
            control=SimpleNamespace(call=lambda op, fields, timeout: {
                "chunks": [c.to_wire() for c in CHUNKS], "map_epoch": 1, "servers": live}),
            book=SimpleNamespace(waiting=lambda: [pending] if not pending.done else [],
                                 pop=self._pop),
            open={0, 1}, links={0: 0, 1: 0}, resent=[], popped=[], pending=pending)

    def _pop(self, request_id: int) -> PendingRequest:
        self.popped.append(request_id)  # taken off the book: only a reply or a resend ends it
        return self.pending

    def reaches(self, rank: int) -> bool:
        return rank in self.open

    def connect(self, servers: list[dict[str, Any]], holding: Any = ()) -> None:
        pass

    def send(self, rank: int, op: str, fields: dict[str, Any], arrays: Any, on_reply: Any,
             route: Any, wait_for_room: bool = True) -> PendingRequest:
        self.resent.append((rank, fields))
        return PendingRequest(100 + len(self.resent), op, rank, on_reply, route=route)


def _setup() -> tuple[PendingRequest, _Channel, Rerouter]:
    table = DenseHandle(DenseTableSpec("model", 20, 10, {"rule": "sgd"}), CHUNKS)
    route = Route(table, [], lambda chunks: ({"table": "model", "chunks": []}, [], None))
    pending = PendingRequest(7, "push", 0, None, route=route, link=0)
    channel = _Channel(pending)
    rerouter = Rerouter(channel)  # type: ignore[arg-type]
    rerouter.track(table, map_epoch=1)
    rerouter.announced, rerouter.announced_members = 1, 2
    return pending, channel, rerouter


def test_a_refresh_that_moves_nothing_leaves_a_closing_push_with_its_server() -> None:
    pending, channel, rerouter = _setup()
    rerouter.run(now=10.0)  # the membership epoch moved: the map is fetched again
    assert rerouter.members_epoch == 2
    assert channel.popped == [] and channel.resent == [] and not pending.done


def test_a_closing_push_goes_to_the_new_process_of_its_rank() -> None:
    pending, channel, rerouter = _setup()
    channel.links[0] = 1  # a new socket: server 0 is a new process
    rerouter.run(now=10.0)
    assert [rank for rank, _ in channel.resent] == [0] and pending.children == 1


def test_a_closing_push_to_a_server_gone_ends_unanswered() -> None:
    pending, channel, rerouter = _setup()
    channel.open = {1}  # server 0 is not a live server any more
    rerouter.run(now=10.0)
    assert channel.resent == [] and pending.done and pending.error is None
