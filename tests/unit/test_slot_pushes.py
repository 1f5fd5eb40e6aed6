"""A server's replicated embedding slots (``--embedding-slots N --replication 2``) without
sockets: it serves the slots it owns while they move, keeps the rows of the slots it owns,
backs up or is about to own, sends a moving slot's rows to its next owner, forwards each push's
rows to the backup and next owner of their slots, and applies a push sent again after an owner
died only for the slots it holds none of that push's rows of."""

from __future__ import annotations

from typing import Any

import numpy as np

from hogshard.proto.hashing import shard_of
from hogshard.proto.packed_rows import pack
from hogshard.proto.wire import Message
from hogshard.ps.embedding_ops import fresh_rows, slot_forwards, slot_keys
from hogshard.ps.embedding_slots import SlotRoles
from hogshard.ps.slot_pushes import SlotPushes
from tests.unit.test_embedding_slots import IDS, SLOTS, FakeLink, push, store

OWNERS = np.arange(SLOTS, dtype=np.int64) % 2  # server 0 owns the even slots, 1 the odd


def roles(moving: dict[int, int]) -> tuple[dict[int, tuple[int, int]], dict[int, int]]:
    """Every slot's (owner, backup): the other server backs it up."""
    return {s: (int(r), int(1 - r)) for s, r in enumerate(OWNERS)}, moving


def push_message(ids: np.ndarray, push_id: int = 5) -> Message:
    grads = np.ones((ids.size, 3), np.float32)
    return Message({"op": "emb_push", "id": 1, "tables": ["e"], "counts": [int(ids.size)],
                    "slots": SLOTS, "push_id": push_id}, [pack([ids]), pack([grads])])


def test_a_replicated_owner_serves_its_moving_slots_and_keeps_what_it_backs_up() -> None:
    slots, embeddings = SlotRoles(), store()
    table, moving = roles({2: 7})
    assert slots.adopt(SLOTS, table, rank=0, moving=moving, replicated=True).size == 0
    assert slots.serving.tolist() == (OWNERS == 0).tolist()  # slot 2 moves, still served
    assert slots.pending_next == {2} and slots.incoming == 0
    push(embeddings, slots, IDS[OWNERS[shard_of(IDS, SLOTS)] == 0])
    # rows of odd slots arrive as its backup's forwards
    embeddings.push(["e"], [IDS], [np.ones((IDS.size, 3), np.float32)])
    rows = embeddings.tables["e"].stats()["rows"]
    gone = slots.adopt(SLOTS, table, rank=0, moving={}, replicated=True)
    assert gone.size == 0 and embeddings.tables["e"].stats()["rows"] == rows
    # server 0 no longer backs up slot 1: its rows go, and they never moved out
    table[1] = (1, 3)
    gone = slots.adopt(SLOTS, table, rank=0, replicated=True)
    assert gone.tolist() == [1]
    slots.drop(embeddings, gone)
    left = embeddings.tables["e"].stats()["rows"]
    assert left == rows - int((shard_of(IDS, SLOTS) == 1).sum())
    assert slots.moved["rows_out"] == slots.moved["slots_out"] == 0


def test_a_moving_slot_is_copied_to_its_next_owner_and_reported_once_acknowledged() -> None:
    slots, embeddings = SlotRoles(), store()
    table, moving = roles({2: 7, 4: 1})  # slot 4's next owner is its backup
    slots.adopt(SLOTS, table, rank=0, moving=moving, replicated=True)
    embeddings.push(["e"], [IDS], [np.ones((IDS.size, 3), np.float32)])
    sent: list[tuple[int, dict[str, Any]]] = []

    def send(owner: int, op: str, fields: dict[str, Any], arrays: list[np.ndarray]) -> int:
        sent.append((owner, fields))
        return len(sent)

    links = {1: FakeLink(), 7: FakeLink()}
    pending = {6}  # slot 6 has a new backup (server 1): a copy that is no move
    slots.send(pending, table, links, send, embeddings)
    assert sorted((owner, f["shards"]) for owner, f in sent) == [(1, [4]), (1, [6]), (7, [2])]
    assert sorted(slots.handoffs) == [2, 4] and slots.ready(links) == []
    assert slots.serving[2] and slots.serving[4]  # served while the copies travel
    links[7].acked = links[1].acked = len(sent)
    links[1].sent = len(sent) + 1  # a push forwarded to their backup since: not acked
    assert slots.ready(links) == []
    assert not slots.serving[2] and not slots.serving[4]  # refused until handed off
    links[1].acked = links[1].sent
    assert slots.ready(links) == [[2, 7], [4, 1]]
    slots.adopt(SLOTS, table, rank=0, moving=moving, replicated=True)  # the same map again
    assert not slots.serving[2] and slots.ready(links) == [[2, 7], [4, 1]]
    slots.resend({7})  # a new link to server 7: its copy goes again, served meanwhile
    assert slots.pending_next == {2} and sorted(slots.handoffs) == [4] and slots.serving[2]


def test_a_push_is_forwarded_to_the_backup_and_next_owner_of_each_slot() -> None:
    slots, embeddings = SlotRoles(), store()
    table, moving = roles({2: 7})
    slots.adopt(SLOTS, table, rank=0, moving=moving, replicated=True)
    ids = IDS[OWNERS[shard_of(IDS, SLOTS)] == 0]
    message = push_message(ids)
    keys = slot_keys(message, SLOTS)
    assert keys is not None
    forwards = {rank: (fields, arrays) for rank, fields, arrays in
                slot_forwards(slots, embeddings, message, keys)}
    assert sorted(forwards) == [1, 7]
    assert forwards[1][1][0] is not None and forwards[1][0]["counts"] == [int(ids.size)]
    to_7 = forwards[7][1][0]
    assert to_7.tolist() == ids[shard_of(ids, SLOTS) == 2].tolist()
    assert forwards[7][1][1].size == 3 * to_7.size


def test_a_push_sent_again_is_applied_for_the_slots_not_yet_held_only() -> None:
    slots, embeddings = SlotRoles(), store()
    table, _ = roles({})
    slots.adopt(SLOTS, table, rank=0, replicated=True)
    ids = IDS[:40]
    first = ids[shard_of(ids, SLOTS) < 8]
    slots.pushes.add(5, shard_of(first, SLOTS))  # forwarded here by the dead owner
    keys = [shard_of(ids, SLOTS)]
    fresh = fresh_rows(slots.pushes, keys, embeddings, push_message(ids))
    assert fresh is not None
    again, again_keys = fresh
    kept = again.arrays[0]
    assert kept.tolist() == ids[shard_of(ids, SLOTS) >= 8].tolist()
    assert again.get("counts") == [kept.size] and again.arrays[1].size == 3 * kept.size
    assert again_keys[0].tolist() == shard_of(kept, SLOTS).tolist()
    assert fresh_rows(slots.pushes, keys, embeddings, push_message(ids)) is None  # all held now
    other = push_message(ids, push_id=6)
    assert fresh_rows(slots.pushes, keys, embeddings, other) == (other, keys)


def test_the_memory_of_pushes_is_bounded() -> None:
    pushes = SlotPushes(max_pushes=2)
    for push_id in (1, 2, 3):
        pushes.add(push_id, np.array([push_id]))
    assert not pushes.seen(1, np.array([1])).any() and len(pushes) == 2
    assert pushes.seen(3, np.array([3, 4])).tolist() == [True, False]
    pushes.add(3, np.array([4]))
    assert pushes.seen(3, np.array([3, 4])).all()
    dense = np.arange(0, 4096, 2)  # most slots of a push: a bitmap of 512 bytes
    budget = SlotPushes(budget_bytes=1600)
    for push_id in range(4):
        budget.add(push_id, dense)
    assert len(budget) == 3 and budget.nbytes == 3 * 512
    probe = np.array([0, 1, 4094, 4095, 9000])
    assert budget.seen(3, probe).tolist() == [True, False, True, False, False]
    budget.add(3, np.array([1, 9000]))  # merged with what it held
    assert budget.seen(3, probe).tolist() == [True, True, True, False, True]
    assert not budget.seen(0, probe).any()  # forgotten: the oldest beyond the budget
