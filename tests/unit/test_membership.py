"""Unit tests of hogshard.scheduler.membership: ranks, liveness, leave, epochs and clocks.

Pure bookkeeping: every call gets its time from the test.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hogshard.proto.errors import (
    ConfigError,
    ErrorCode,
    FencedError,
    HogshardError,
    UnknownMemberError,
)
from hogshard.scheduler.membership import MembershipTable, MemberState

TIMEOUT = 3.0


@pytest.fixture
def table() -> MembershipTable:
    return MembershipTable(heartbeat_timeout=TIMEOUT)


def ranks(table: MembershipTable, role: str = "worker") -> list[int]:
    return [m.rank for m in table.live(role)]


# ---------------------------------------------------------------------------------------------
# ranks
# ---------------------------------------------------------------------------------------------


def test_docstring_example(table: MembershipTable) -> None:
    w = table.register("worker", address="", now=0.0)
    assert (w.node_id, w.rank) == ("worker-0", 0)
    assert [m.node_id for m in table.expire(now=10.0)] == ["worker-0"]


def test_ranks_count_up_per_role(table: MembershipTable) -> None:
    ids = [table.register("worker", "", now=0.0).node_id for _ in range(3)]
    assert ids == ["worker-0", "worker-1", "worker-2"]
    server = table.register("server", "tcp://h:1", now=0.0)
    assert (server.node_id, server.rank, server.address) == ("server-0", 0, "tcp://h:1")
    assert table.live("server")[0] is server


def test_lowest_free_rank_fills_gaps(table: MembershipTable) -> None:
    for _ in range(4):
        table.register("worker", "", now=0.0)
    table.touch("worker-0", now=TIMEOUT + 1)
    table.touch("worker-3", now=TIMEOUT + 1)
    assert [m.node_id for m in table.expire(now=TIMEOUT + 1)] == ["worker-1", "worker-2"]
    assert table.register("worker", "", now=1.0).rank == 1
    assert table.register("worker", "", now=1.0).rank == 2
    assert table.register("worker", "", now=1.0).rank == 4


def test_rank_hint_honoured_when_free(table: MembershipTable) -> None:
    assert table.register("worker", "", now=0.0, rank_hint=5).rank == 5
    # the hint does not shift the lowest-free rule for others
    assert table.register("worker", "", now=0.0).rank == 0
    assert table.register("worker", "", now=0.0).rank == 1
    assert ranks(table) == [0, 1, 5]


def test_rank_hint_taken_falls_back_to_lowest_free(table: MembershipTable) -> None:
    table.register("worker", "", now=0.0)
    table.register("worker", "", now=0.0)
    assert table.register("worker", "", now=0.0, rank_hint=0).rank == 2


@pytest.mark.parametrize("hint", [-1, -100])
def test_negative_rank_hint_is_ignored(table: MembershipTable, hint: int) -> None:
    assert table.register("worker", "", now=0.0, rank_hint=hint).rank == 0


def test_rank_hint_of_other_role_does_not_collide(table: MembershipTable) -> None:
    table.register("server", "", now=0.0, rank_hint=0)
    assert table.register("worker", "", now=0.0, rank_hint=0).rank == 0


def test_reregistration_after_death_reuses_rank(table: MembershipTable) -> None:
    table.register("worker", "", now=0.0)
    w1 = table.register("worker", "", now=0.0)
    table.touch("worker-0", now=TIMEOUT + 1)
    assert table.expire(now=TIMEOUT + 1) == [w1]
    # with its old rank as a hint (what PSClient.reregister sends)
    again = table.register("worker", "", now=TIMEOUT + 2, rank_hint=1)
    assert (again.node_id, again.rank, again.state) == ("worker-1", 1, MemberState.ALIVE)
    assert table.get("worker-1") is again
    assert again is not w1


def test_reregistration_without_hint_takes_dead_rank(table: MembershipTable) -> None:
    table.register("server", "a", now=0.0)
    table.expire(now=TIMEOUT + 1)
    assert table.register("server", "b", now=TIMEOUT + 2).node_id == "server-0"
    assert table.get("server-0").address == "b"


def test_unknown_role_is_refused(table: MembershipTable) -> None:
    with pytest.raises(ConfigError, match="role"):
        table.register("client", "", now=0.0)
    assert table.epoch == 0


def test_register_sets_clock_and_times(table: MembershipTable) -> None:
    m = table.register("worker", "", now=4.5, clock=7)
    assert (m.clock, m.registered_at, m.last_seen) == (7, 4.5, 4.5)
    assert m.alive


@pytest.mark.parametrize("hint", [True, 1.5])
def test_non_integer_rank_hint_never_makes_a_non_integer_rank(
    table: MembershipTable, hint: object
) -> None:
    try:
        member = table.register("worker", "", now=0.0, rank_hint=hint)  # type: ignore[arg-type]
    except HogshardError:
        return  # refusing the hint is fine too
    assert type(member.rank) is int
    assert member.node_id in {"worker-0", "worker-1"}


# ---------------------------------------------------------------------------------------------
# liveness
# ---------------------------------------------------------------------------------------------


def test_expire_after_timeout_not_before(table: MembershipTable) -> None:
    m = table.register("worker", "", now=10.0)
    assert table.expire(now=10.0 + TIMEOUT) == []  # silent exactly the timeout: still alive
    assert m.alive
    assert table.expire(now=10.0 + TIMEOUT + 1e-6) == [m]
    assert m.state is MemberState.DEAD
    assert table.live("worker") == []
    assert table.expire(now=100.0) == []  # a dead member is not declared dead twice


def test_touch_postpones_expiry(table: MembershipTable) -> None:
    m = table.register("worker", "", now=0.0)
    table.touch(m.node_id, now=2.5)
    assert m.last_seen == 2.5
    assert table.expire(now=5.0) == []
    assert table.expire(now=5.6) == [m]


def test_expire_only_silent_members(table: MembershipTable) -> None:
    a = table.register("worker", "", now=0.0)
    b = table.register("worker", "", now=0.0)
    s = table.register("server", "", now=0.0)
    table.touch(b.node_id, now=3.0)
    dead = table.expire(now=4.0)
    assert {m.node_id for m in dead} == {a.node_id, s.node_id}
    assert [m.node_id for m in table.live("worker")] == [b.node_id]


def test_dead_member_is_unknown(table: MembershipTable) -> None:
    m = table.register("worker", "", now=0.0)
    table.expire(now=TIMEOUT * 2)
    for call in (lambda: table.get(m.node_id), lambda: table.touch(m.node_id, 9.0),
                 lambda: table.leave(m.node_id)):
        with pytest.raises(UnknownMemberError, match="dead") as info:
            call()
        assert info.value.code is ErrorCode.UNKNOWN_MEMBER
        assert "register again" in info.value.message


@pytest.mark.parametrize("node_id", ["worker-9", "server-0", "", "worker-?"])
def test_unknown_member(table: MembershipTable, node_id: str) -> None:
    table.register("worker", "", now=0.0)
    with pytest.raises(UnknownMemberError, match="unknown"):
        table.touch(node_id, now=1.0)


# ---------------------------------------------------------------------------------------------
# leave
# ---------------------------------------------------------------------------------------------


def test_leave_removes_from_live(table: MembershipTable) -> None:
    a = table.register("worker", "", now=0.0)
    b = table.register("worker", "", now=0.0)
    left = table.leave(a.node_id)
    assert left is a and a.state is MemberState.DONE and not a.alive
    assert table.live("worker") == [b]
    assert a.node_id not in table.live_clocks()
    with pytest.raises(UnknownMemberError, match="done"):
        table.leave(a.node_id)
    # a member that left is never declared dead afterwards
    assert table.expire(now=100.0) == [b]
    assert a.state is MemberState.DONE


def test_iteration_keeps_departed_members(table: MembershipTable) -> None:
    table.register("worker", "", now=0.0)
    table.register("worker", "", now=0.0)
    table.leave("worker-0")
    table.expire(now=100.0)
    states = {m.node_id: m.state for m in table}
    assert states == {"worker-0": MemberState.DONE, "worker-1": MemberState.DEAD}


# ---------------------------------------------------------------------------------------------
# epoch
# ---------------------------------------------------------------------------------------------


def test_epoch_counts_membership_changes(table: MembershipTable) -> None:
    assert table.epoch == 0
    table.register("worker", "", now=0.0)
    table.register("worker", "", now=0.0)
    table.register("server", "", now=0.0)
    assert table.epoch == 3
    table.touch("worker-0", now=1.0)
    table.get("worker-0")
    table.live_clocks()
    assert table.epoch == 3  # reads and heartbeats change nothing
    table.leave("worker-0")
    assert table.epoch == 4
    assert table.expire(now=1.0) == []
    assert table.epoch == 4
    assert len(table.expire(now=10.0)) == 2  # two deaths in one sweep: one epoch
    assert table.epoch == 5
    table.register("worker", "", now=11.0)
    assert table.epoch == 6


# ---------------------------------------------------------------------------------------------
# clocks
# ---------------------------------------------------------------------------------------------


def test_live_clocks_and_min(table: MembershipTable) -> None:
    assert table.live_clocks() == {}
    assert table.min_live_clock() == 0
    table.register("worker", "", now=0.0, clock=5)
    table.register("worker", "", now=0.0, clock=3)
    table.register("server", "", now=0.0)  # servers carry no clock
    assert table.live_clocks() == {"worker-0": 5, "worker-1": 3}
    assert table.min_live_clock() == 3
    table.get("worker-1").clock = 9
    assert table.min_live_clock() == 5


def test_min_live_clock_ignores_dead_and_departed(table: MembershipTable) -> None:
    table.register("worker", "", now=0.0, clock=1)
    table.register("worker", "", now=0.0, clock=2)
    table.register("worker", "", now=5.0, clock=8)
    table.leave("worker-1")
    table.expire(now=4.0)  # worker-0 silent for 4 s
    assert table.live_clocks() == {"worker-2": 8}
    assert table.min_live_clock() == 8


def test_live_is_sorted_by_rank(table: MembershipTable) -> None:
    for hint in (4, 2, 7, 0):
        table.register("server", "", now=0.0, rank_hint=hint)
    assert ranks(table, "server") == [0, 2, 4, 7]


# ---------------------------------------------------------------------------------------------
# a random history
# ---------------------------------------------------------------------------------------------

ops = st.lists(
    st.tuples(
        st.sampled_from(["register", "leave", "touch", "tick"]),
        st.sampled_from(["worker", "server"]),
        st.integers(-1, 6),
    ),
    max_size=60,
)


@settings(deadline=None, max_examples=300)
@given(ops)
def test_random_history_keeps_ranks_unique_and_lowest_free(history) -> None:
    table = MembershipTable(heartbeat_timeout=TIMEOUT)
    now, epoch = 0.0, 0
    for op, role, arg in history:
        if op == "register":
            taken = {m.rank for m in table.live(role)}
            if role == "worker":  # a rank whose worker left is never handed out again
                taken |= {m.rank for m in table if m.role == role
                          and m.state is MemberState.DONE}
            hint = arg if arg >= 0 and arg % 2 == 0 else None
            member = table.register(role, "", now=now, rank_hint=hint)
            if hint is not None and hint not in taken:
                assert member.rank == hint
            else:
                assert member.rank == min(set(range(len(taken) + 1)) - taken)
            epoch += 1
        elif op in ("leave", "touch"):
            live = table.live(role)
            if not live:
                continue
            target = live[arg % len(live)].node_id
            if op == "leave":
                table.leave(target)
                epoch += 1
            else:
                table.touch(target, now)
        else:
            now += abs(arg)
            if table.expire(now):
                epoch += 1
        assert table.epoch == epoch
        for r in ("worker", "server"):
            live_ranks = ranks(table, r)
            assert len(live_ranks) == len(set(live_ranks))
            assert all(now - m.last_seen <= TIMEOUT or op != "tick" for m in table.live(r))


# ---------------------------------------------------------------------------------------------
# finished worker ranks, server incarnations
# ---------------------------------------------------------------------------------------------


def test_rank_of_a_finished_worker_is_not_handed_out_again(table: MembershipTable) -> None:
    table.register("worker", "", now=0.0)
    table.register("worker", "", now=0.0)
    table.leave("worker-0")
    assert table.register("worker", "", now=1.0).rank == 2  # not 0: its data is trained
    assert table.register("worker", "", now=1.0, rank_hint=0).rank == 3
    table.expire(now=10.0)  # all silent: a dead worker's rank is free for its restart
    assert table.register("worker", "", now=11.0).rank == 1


def test_a_new_incarnation_takes_its_rank_over_and_the_old_is_fenced(
        table: MembershipTable) -> None:
    old = table.register("server", "tcp://a:1", now=0.0, rank_hint=1, incarnation=7)
    assert table.fence("server", 1, 7) is None  # the same process: nothing to fence
    replaced = table.fence("server", 1, 8)
    assert replaced is old and old.state is MemberState.DEAD
    new = table.register("server", "tcp://a:1", now=0.5, rank_hint=1, incarnation=8)
    assert (new.node_id, new.incarnation, new.previous) == ("server-1", 8, old)
    with pytest.raises(FencedError, match="replaced"):
        table.touch("server-1", now=0.6, incarnation=7)
    with pytest.raises(FencedError):
        table.fence("server", 1, 7)
    with pytest.raises(FencedError):
        table.register("server", "tcp://a:1", now=0.7, rank_hint=1, incarnation=7)
    assert table.touch("server-1", now=0.8, incarnation=8) is new
    assert FencedError("x").code is ErrorCode.FENCED


def test_the_same_incarnation_registering_again_keeps_its_entry(table: MembershipTable) -> None:
    first = table.register("server", "tcp://a:1", now=0.0, rank_hint=0, incarnation=5)
    again = table.register("server", "tcp://a:2", now=1.0, rank_hint=0, incarnation=5)
    assert again is first and again.address == "tcp://a:2" and ranks(table, "server") == [0]
    # without an incarnation a live rank is never taken over
    assert table.fence("server", 0, None) is None
    assert table.register("server", "", now=1.0, rank_hint=0).rank == 1


def test_a_scheduler_that_did_not_run_holds_no_silence_against_its_members(
        table: MembershipTable) -> None:
    """Frozen from 1.0 to 9.0 (SIGSTOP, a suspended VM): the heartbeats sent meanwhile wait
    unread, so on waking nobody is declared dead for those 8 s, only for silence after."""
    server = table.register("server", address="tcp://a:1", now=1.0)
    worker = table.register("worker", address="", now=0.5)
    table.excuse(gap=8.0, now=9.0)
    assert table.expire(now=9.0) == []
    assert (server.last_seen, worker.last_seen) == (9.0, 8.5)
    assert [m.node_id for m in table.expire(now=12.0)] == ["worker-0"]  # 3.5 s of its own


def test_a_rank_claim_is_refused_once_its_holder_is_heard_after_it() -> None:
    from hogshard.proto.errors import ConflictError
    from hogshard.scheduler.membership import Member
    from hogshard.scheduler.rejoin import RankClaim

    holder = Member("server", 1, "tcp://10.0.0.5:7001", 0.0, last_seen=0.0, incarnation=7)
    claim = RankClaim(holder, 8, "tcp://10.0.0.6:7001", at=1.0, window=2.0, quiet=0.5)
    holder.last_seen = 1.2  # read just after the claim: it may have waited in the socket
    assert not claim.settled(1.3)
    holder.last_seen = 1.6  # a heartbeat well after the claim: the holder is alive
    with pytest.raises(ConflictError, match=r"server rank 1 is held by a live server: "
                                            r"server-1 at tcp://10\.0\.0\.5:7001 \(incarnation 7"):
        claim.settled(1.7)
    dead = Member("server", 1, "tcp://10.0.0.5:7001", 0.0, last_seen=0.0, incarnation=7)
    claim = RankClaim(dead, 8, "tcp://10.0.0.6:7001", at=1.0, window=2.0, quiet=0.5)
    dead.state = MemberState.DEAD  # declared dead meanwhile: no need to wait the window out
    assert claim.settled(1.1)


def test_a_worker_stopped_before_its_work_is_done_frees_its_rank(table: MembershipTable) -> None:
    table.num_workers = 2
    first = table.register("worker", "", now=0.0, rank_hint=0)
    table.leave(first.node_id, stopped=True)
    assert first.state is MemberState.DEAD
    assert table.register("worker", "", now=1.0, rank_hint=0).rank == 0
    done = table.register("worker", "", now=1.0, rank_hint=1)
    table.leave(done.node_id)
    assert done.state is MemberState.DONE
