"""Unit tests of hogshard.ps.embedding_slots: a server's side of a slot's move, as a state
machine driven by map changes (no sockets). An owner serves a slot until the map says it
moves, then refuses it whole, copies every row of it (values and row-wise state) to the next
owner, reports the hand-off only once acknowledged, and drops the rows once the map gives the
slot away; the next owner then holds exactly the rows every acknowledged push made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from hogshard.proto.errors import NotOwnerError
from hogshard.proto.hashing import shard_of
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.embedding_replica import install_rows
from hogshard.ps.embedding_slots import SlotRoles
from hogshard.ps.embedding_store import EmbeddingStore

SLOTS = 16
SPEC = EmbeddingSpec("e", dim=3, num_embeddings=None,
                     rule={"rule": "rowwise_adagrad", "lr": 0.1}, seed=1)
IDS = np.arange(200, dtype=np.int64)


@dataclass
class FakeLink:
    sent: int = 0
    acked: int = 0
    fenced: str | None = None


def roles_for(owners: np.ndarray, moving: dict[int, int]) -> dict[int, tuple[int, int]]:
    return {s: (int(r), moving.get(s, -1)) for s, r in enumerate(owners)}


def store() -> EmbeddingStore:
    embeddings = EmbeddingStore()
    embeddings.create(SPEC)
    return embeddings


def push(embeddings: EmbeddingStore, slots: SlotRoles, ids: np.ndarray, rank: int = 0) -> None:
    """A push as EmbeddingOps serves it: refused whole unless every slot is served."""
    slots.check(SLOTS, [ids], rank, epoch=1)
    embeddings.push(["e"], [ids], [np.ones((ids.size, 3), np.float32)])


def test_a_moving_slot_is_refused_copied_reported_when_acked_and_dropped_when_gone() -> None:
    owners = np.zeros(SLOTS, np.int64)  # server 0 owns every slot
    a, b = store(), store()
    a_slots, b_slots = SlotRoles(), SlotRoles()
    assert a_slots.adopt(SLOTS, roles_for(owners, {}), rank=0).size == 0
    b_slots.adopt(SLOTS, roles_for(owners, {}), rank=1)
    push(a, a_slots, IDS)
    expected = a.pull(["e"], [IDS])[0]
    moving = {3: 1, 7: 1}
    a_slots.adopt(SLOTS, roles_for(owners, moving), rank=0)
    b_slots.adopt(SLOTS, roles_for(owners, moving), rank=1)
    assert b_slots.incoming == 2 and not b_slots.serving.any()  # it asks for the map sooner
    in_3 = IDS[shard_of(IDS, SLOTS) == 3]
    others = IDS[~np.isin(shard_of(IDS, SLOTS), [3, 7])]
    with pytest.raises(NotOwnerError, match="slot 3"):
        push(a, a_slots, np.concatenate([others[:5], in_3[:1]]))  # refused whole
    push(a, a_slots, others[:5])  # slots that stay are served on
    expected = a.pull(["e"], [IDS])[0]

    sent: list[tuple[int, str, dict[str, Any], list[np.ndarray]]] = []

    def send(owner: int, op: str, fields: dict[str, Any], arrays: list[np.ndarray]) -> int:
        sent.append((owner, op, fields, arrays))
        return len(sent)

    link = FakeLink()
    pending = {3, 7}
    assert a_slots.send(pending, roles_for(owners, moving), {1: link}, send, a) == {1: 1}
    assert not pending
    [(owner, op, fields, arrays)] = sent
    assert (owner, op, fields["shards"]) == (1, "emb_snapshot", [3, 7])
    ids, rows, accumulator = arrays
    assert set(shard_of(ids, SLOTS).tolist()) == {3, 7}
    assert a_slots.ready({1: link}) == []  # not acknowledged yet
    link.fenced = "refused"
    link.acked = 1
    assert a_slots.ready({1: link}) == []  # refused: never reported
    link.fenced = None
    assert a_slots.ready({1: link}) == [[3, 1], [7, 1]]

    install_rows(b.table("e"), ids, rows, {"sum": accumulator})  # what emb_snapshot does
    handed = owners.copy()
    handed[[3, 7]] = 1
    gone = a_slots.adopt(SLOTS, roles_for(handed, {}), rank=0)
    assert gone.tolist() == [3, 7] and a_slots.handoffs == {}
    dropped = a_slots.drop(a, gone)
    assert dropped == ids.size and a.table("e").rows == IDS.size - ids.size
    seconds = a_slots.moved.pop("seconds_out")
    assert a_slots.moved == {"slots_out": 2, "rows_out": ids.size, "slots_in": 0, "rows_in": 0,
                             "bytes_out": a_slots.moved["bytes_out"], "bytes_in": 0}
    assert a_slots.moved["bytes_out"] >= ids.size * (8 + 3 * 4) and seconds > 0  # ids and rows
    b_slots.adopt(SLOTS, roles_for(handed, {}), rank=1)
    assert b_slots.incoming == 0 and b_slots.serving[[3, 7]].all()
    mine = IDS[np.isin(shard_of(IDS, SLOTS), [3, 7])]
    b_slots.check(SLOTS, [mine], 1, epoch=2)
    np.testing.assert_array_equal(b.pull(["e"], [mine])[0],
                                  expected[np.isin(shard_of(IDS, SLOTS), [3, 7])])
    held = b.table("e").index.lookup(ids)
    np.testing.assert_array_equal(b.table("e").state["sum"][held], accumulator)  # state moved
    assert (accumulator > 0).all()
    with pytest.raises(NotOwnerError):
        a_slots.check(SLOTS, [mine], 0, epoch=2)


def test_a_request_hashed_over_another_slot_count_is_refused() -> None:
    slots = SlotRoles()
    with pytest.raises(NotOwnerError, match="0 embedding slots"):
        slots.check(SLOTS, [IDS], 0, epoch=None)  # no map yet
    slots.adopt(SLOTS, roles_for(np.zeros(SLOTS, np.int64), {}), rank=0)
    with pytest.raises(NotOwnerError, match="hashed them over 8"):
        slots.check(8, [IDS], 0, epoch=1)
    slots.check(SLOTS, [IDS, np.empty(0, np.int64), IDS.astype(np.float32)], 0, epoch=1)
    slots.check(None, [IDS], 0, epoch=1)  # a job without slots: rows by the old hash
    slots.required = SLOTS
    with pytest.raises(NotOwnerError, match="fetch the slot map"):
        slots.check(None, [IDS], 0, epoch=1)  # would place rows by the old hash


def test_a_called_off_move_serves_the_slot_again_and_forgets_the_hand_off() -> None:
    owners = np.zeros(SLOTS, np.int64)
    slots = SlotRoles()
    slots.adopt(SLOTS, roles_for(owners, {5: 2}), rank=0)
    slots.handoffs[5] = (2, 1)
    assert not slots.serving[5]
    assert slots.adopt(SLOTS, roles_for(owners, {}), rank=0).size == 0
    assert slots.serving[5] and slots.handoffs == {}


def test_slots_taken_without_a_hand_off_are_logged_as_lost(caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    slots = SlotRoles()
    slots.adopt(SLOTS, roles_for(np.zeros(SLOTS, np.int64), {}), rank=0)
    elsewhere = np.zeros(SLOTS, np.int64)
    elsewhere[[2, 9]] = 1  # a map placed afresh (a restarted scheduler), no move before
    with caplog.at_level("ERROR"):
        assert slots.adopt(SLOTS, roles_for(elsewhere, {}), rank=0).tolist() == [2, 9]
    assert "without a hand-off" in caplog.text
