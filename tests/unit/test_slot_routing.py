"""A worker's routing of embedding rows by slot (``--embedding-slots``): one request per
server that owns slots, each id to the owner of its slot, ``slots: N`` in place of ``shard``
and no push id; a request refused while its slots move is rebuilt for any subset of them; and
the rerouter never sends such a request again while it waits for its (live) old owner."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from hogshard.proto.hashing import shard_of
from hogshard.proto.tables import EMBEDDING_MAP, Chunk, DenseTableSpec, EmbeddingSpec
from hogshard.proto.wire import Message
from hogshard.worker.futures import Future, PendingRequest
from hogshard.worker.rerouting import Rerouter
from hogshard.worker.sparse import EmbeddingHandle, pull_rows, push_rows
from hogshard.worker.tables import DenseHandle

SLOTS = 32
OWNERS = [s % 3 for s in range(SLOTS)]  # servers 0, 1 and 2
HANDLE = EmbeddingHandle(EmbeddingSpec("e", dim=2, num_embeddings=None, rule={"rule": "sgd"}))


def slot_map(owners: list[int]) -> DenseHandle:
    return DenseHandle(DenseTableSpec(EMBEDDING_MAP, SLOTS, 1, {}),
                      [Chunk(s, s, 1, r) for s, r in enumerate(owners)], slots=SLOTS)


class FakeChannel(SimpleNamespace):
    """Records the requests instead of sending them."""

    def __init__(self) -> None:
        super().__init__(sent=[])

    def pump(self, timeout: float) -> None:
        raise AssertionError("nothing to wait for")

    def request(self, rank: int, op: str, fields: dict[str, Any], arrays: list[np.ndarray],
                on_reply: Any = None, route: Any = None) -> Future:
        self.sent.append((rank, op, fields, arrays, on_reply, route))
        return Future([PendingRequest(len(self.sent), op, rank, on_reply)], self.pump)

    def gather(self, futures: list[Future]) -> Future:
        return Future.gather(futures, self.pump)


class FakeClient(SimpleNamespace):
    """A client whose channel records the requests."""

    def __init__(self, table: DenseHandle) -> None:
        channel = FakeChannel()
        super().__init__(embedding_map=table, bytes_pushed=0, channel=channel, sent=channel.sent)

    def new_push_id(self) -> int:
        raise AssertionError("slot requests carry no push id")


def test_each_id_goes_to_the_owner_of_its_slot() -> None:
    client = FakeClient(slot_map(OWNERS))
    ids = np.arange(100, dtype=np.int64)[::-1].copy()
    push_rows(client, [HANDLE], [ids], [np.ones((100, 2), np.float32)])  # type: ignore[arg-type]
    assert [rank for rank, *_ in client.sent] == [0, 1, 2]
    seen = []
    for rank, op, fields, (sent_ids, grads), _, route in client.sent:
        assert op == "emb_push"
        assert fields == {"tables": ["e"], "slots": SLOTS, "counts": [sent_ids.size]}
        slots = shard_of(sent_ids, SLOTS)
        assert all(OWNERS[s] == rank for s in slots) and grads.shape == (sent_ids.size * 2,)
        assert route.follow is False and route.chunk_ids == sorted(set(slots.tolist()))
        seen += sent_ids.tolist()
    assert sorted(seen) == list(range(100))
    assert client.bytes_pushed == 100 * 8 + 100 * 2 * 4


def test_a_refused_pull_is_rebuilt_for_the_slots_of_each_new_owner() -> None:
    client = FakeClient(slot_map(OWNERS))
    ids = np.arange(60, dtype=np.int64)
    out = np.zeros((60, 2), np.float32)
    pull_rows(client, [HANDLE], [ids], [out])  # type: ignore[arg-type]
    rank, _, fields, (sent_ids,), _, route = client.sent[0]
    assert rank == 0 and fields["slots"] == SLOTS
    some = [Chunk(s, s, 1, 1) for s in route.chunk_ids[:2]]  # two of its slots moved
    sub_fields, (sub_ids,), land = route.build(some)
    assert sub_fields["slots"] == SLOTS and sub_fields["counts"] == [sub_ids.size]
    assert set(shard_of(sub_ids, SLOTS).tolist()) == set(route.chunk_ids[:2])
    rows = np.stack([sub_ids, -sub_ids], axis=1).astype(np.float32)
    land(Message({"v": 1, "op": "ok", "id": 1}, [rows.reshape(-1)]))  # packed: one flat array
    np.testing.assert_array_equal(out[sub_ids, 0], sub_ids)  # landed where they belong
    untouched = np.setdiff1d(ids, sub_ids)
    assert (out[untouched] == 0).all()


def test_an_empty_request_still_follows_a_slot_of_its_server() -> None:
    client = FakeClient(slot_map(OWNERS))
    pull_rows(client, [HANDLE], [np.empty(0, np.int64)],  # type: ignore[arg-type]
              [np.empty((0, 2), np.float32)])
    assert [(rank, route.chunk_ids) for rank, *_, route in client.sent] == [
        (0, [0]), (1, [1]), (2, [2])]


def test_the_rerouter_leaves_waiting_slot_requests_with_their_old_owner() -> None:
    table = slot_map(OWNERS)
    client = FakeClient(table)
    pull_rows(client, [HANDLE], [np.arange(10, dtype=np.int64)],  # type: ignore[arg-type]
              [np.zeros((10, 2), np.float32)])
    route = client.sent[0][-1]
    pending = PendingRequest(1, "emb_pull", 0, None, route=route)
    book = SimpleNamespace(waiting=lambda: [pending], pop=lambda request_id: pending)
    # server 0 is still the process the request went to (same link)
    rerouter = Rerouter(SimpleNamespace(book=book, reaches=lambda rank: rank in (0, 1, 2),
                                        links={0: pending.link}))  # type: ignore[arg-type]
    table.update([Chunk(s, s, 1, 1) for s in range(SLOTS)])  # every slot moved to server 1
    rerouter._reroute_waiting()
    assert pending.children == 0  # not sent again: server 0 answers it (or refuses it)


class _MembershipChannel(SimpleNamespace):
    """A channel whose scheduler no longer lists server 2 once it was found dead: the map
    (the same epoch) has every slot on servers 0 and 1."""

    def __init__(self, pending: PendingRequest, table: DenseHandle) -> None:
        chunks = [c.to_wire() for c in table.chunks]
        live = [{"rank": r, "address": f"tcp://s{r}"} for r in (0, 1)]
        super().__init__(
            node_id="worker-0", settings=SimpleNamespace(connect_timeout=1.0),
            control=SimpleNamespace(call=lambda op, fields, timeout: {
                "chunks": chunks, "map_epoch": 7, "servers": live}),
            book=SimpleNamespace(waiting=lambda: [pending], pop=lambda request_id: pending),
            open={0, 1, 2}, links={0: 0, 1: 0, 2: 0}, resent=[])

    def reaches(self, rank: int) -> bool:
        return rank in self.open

    def connect(self, servers: list[dict[str, Any]], holding: Any = ()) -> None:
        self.open = {int(s["rank"]) for s in servers} | (self.open & set(holding))

    def send(self, rank: int, op: str, fields: dict[str, Any], arrays: Any, on_reply: Any,
             route: Any, wait_for_room: bool = True) -> PendingRequest:
        self.resent.append((rank, route.chunk_ids))
        return PendingRequest(100 + len(self.resent), op, rank, on_reply, route=route)


def test_a_request_waiting_on_a_server_lost_without_a_map_move_is_sent_again() -> None:
    """Server 2 was drained (the map moved its slots away) and stopped after the worker sent
    it a push on the old map: the map epoch does not move when the scheduler finds server 2
    dead, only the membership epoch does; the worker fetches the map on that, drops the
    socket to server 2 and sends the push to the slots' owners."""
    table = slot_map(OWNERS)
    client = FakeClient(table)
    push_rows(client, [HANDLE], [np.arange(30, dtype=np.int64)],  # type: ignore[arg-type]
              [np.ones((30, 2), np.float32)])
    rank, *_, route = client.sent[2]
    assert rank == 2
    pending = PendingRequest(3, "emb_push", 2, None, route=route, link=0)
    table.update([Chunk(s, s, 1, s % 2) for s in range(SLOTS)])  # drained: on servers 0 and 1
    channel = _MembershipChannel(pending, table)
    rerouter = Rerouter(channel)  # type: ignore[arg-type]
    rerouter.track(table, map_epoch=7)
    rerouter.announced, rerouter.announced_members = 7, 4
    rerouter.members_epoch = 4  # the map was fetched while server 2 was still listed live
    rerouter.run(now=10.0)
    assert channel.resent == [] and pending.children == 0  # nothing says server 2 is gone

    rerouter.announced_members = 5  # the scheduler found server 2 dead
    rerouter.run(now=11.0)
    assert not channel.reaches(2)
    assert sorted(r for r, _ in channel.resent) == [0, 1] and pending.children == 2
    sent_slots = sorted(s for _, slots in channel.resent for s in slots)
    assert sent_slots == route.chunk_ids and rerouter.members_epoch == 5
