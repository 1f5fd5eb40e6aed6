"""The peer gate: which server-to-server messages a shard server applies, holds or refuses,
given the shard map it knows (no sockets: the Replicator's roles are set directly)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from hogshard.proto.errors import ForbiddenError, NotOwnerError, NotReadyError
from hogshard.proto.requests import Request
from hogshard.proto.wire import Message
from hogshard.ps import peer_gate
from hogshard.ps.peer_gate import PeerGate
from hogshard.ps.replication import Replicator

RANK = 1  # this server


@pytest.fixture
def replicas() -> Iterator[Replicator]:
    context = zmq.Context()
    replicas = Replicator(context, None, heartbeat_timeout=5.0, sender="server-1")
    replicas.map_epoch = 10
    replicas.roles = {"model": {0: (0, RANK), 1: (RANK, 0), 2: (2, 0)}}
    try:
        yield replicas
    finally:
        replicas.close()
        context.term()


def message(sender: str = "server-0", epoch: int | None = 10, **fields: Any) -> Message:
    return Message({"v": 1, "op": "replicate", "id": 1, "from": sender, "map_epoch": epoch,
                    **fields})


def gate(replication: int | None = 2) -> tuple[PeerGate, list[int]]:
    woken: list[int] = []
    return PeerGate(lambda: woken.append(1), replication), woken


def test_the_primary_named_by_the_map_is_admitted(replicas: Replicator) -> None:
    g, woken = gate()
    assert g.admit(Request(b"p0", message()), replicas, RANK, "model", [0])
    assert not g.held and not woken


@pytest.mark.parametrize(("sender", "table", "chunks", "error", "words"), [
    ("server-2", "model", [0], ForbiddenError, ("server 2", "chunk 0")),
    ("worker-0", "model", [0], ForbiddenError, ("shard server",)),
    ("intruder", "model", [0], ForbiddenError, ("from='intruder'",)),
    ("server-0", "other", [0], ForbiddenError, ("'other'",)),
    ("server-0", "model", [0, 7], ForbiddenError, ("chunk 7",)),
    ("server-0", "model", [1], NotOwnerError, ("no longer the backup",)),
    ("server-2", "model", [2], NotOwnerError, ("no longer the backup",)),
])
def test_anything_else_is_refused(replicas: Replicator, sender: str, table: str,
                                  chunks: list[int], error: type, words: tuple[str, ...]) -> None:
    g, _ = gate()
    with pytest.raises(error) as caught:
        g.admit(Request(b"x", message(sender)), replicas, RANK, table, chunks)
    for word in words:
        assert word in caught.value.message


def test_an_unreplicated_job_refuses_every_server_to_server_op(replicas: Replicator) -> None:
    g, _ = gate(replication=1)
    with pytest.raises(ForbiddenError, match="not replicated"):
        g.admit(Request(b"p0", message()), replicas, RANK, "model", [0])


def test_a_newer_map_is_awaited_then_decided_in_order(replicas: Replicator) -> None:
    g, woken = gate()
    first, second = message(epoch=11, seq=1), message(epoch=10, seq=2)
    assert not g.admit(Request(b"p0", first), replicas, RANK, "new", [0])
    assert not g.admit(Request(b"p0", second), replicas, RANK, "model", [0])  # behind the first
    assert g.admit(Request(b"p9", message()), replicas, RANK, "model", [0])  # another link: no wait
    assert len(g.held) == 2 and woken
    decided: list[tuple[Any, Exception | None]] = []

    def redo(request: Request, late: Exception | None) -> None:
        try:
            table = "new" if request.message is first else "model"
            decided.append((g.admit(request, replicas, RANK, table, [0]), late))
        except ForbiddenError as err:
            decided.append((err, late))

    g.release(map_heard_at=list(g.held)[0].arrived_at - 1.0, redo=redo)  # a heartbeat from before
    assert not decided
    replicas.map_epoch, replicas.roles["new"] = 11, {0: (0, RANK)}
    g.release(map_heard_at=list(g.held)[-1].arrived_at, redo=redo)
    assert decided == [(True, None), (True, None)] and not g.held


def test_a_claim_of_a_newer_map_is_refused_once_the_map_is_known(replicas: Replicator) -> None:
    g, _ = gate()
    assert not g.admit(Request(b"p0", message(epoch=99)), replicas, RANK, "model", [5])
    outcomes: list[Any] = []

    def redo(request: Request, late: Exception | None) -> None:
        with pytest.raises(ForbiddenError, match="epoch 10"):
            g.admit(request, replicas, RANK, "model", [5])
        outcomes.append(late)

    g.release(map_heard_at=list(g.held)[0].arrived_at, redo=redo)
    assert outcomes == [None] and not g.held


def test_held_messages_are_bounded_in_number_and_time(replicas: Replicator,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    g, _ = gate()
    monkeypatch.setattr(peer_gate, "MAX_HELD", 2)
    assert not g.admit(Request(b"a", message(epoch=11)), replicas, RANK, "model", [5])
    assert not g.admit(Request(b"b", message(epoch=11)), replicas, RANK, "model", [5])
    with pytest.raises(ForbiddenError, match="at most 2"):
        g.admit(Request(b"c", message(epoch=11)), replicas, RANK, "model", [5])
    monkeypatch.setattr(peer_gate, "MAX_WAIT_S", -1.0)
    late: list[Exception | None] = []
    g.release(map_heard_at=0.0, redo=lambda request, error: late.append(error))
    assert len(late) == 2 and all(isinstance(e, NotReadyError) for e in late)
