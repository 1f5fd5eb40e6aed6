"""Unit tests of hogshard.proto.policy: parsing ``async`` and ``ssp:S`` and the SSP read gate.

Pure logic; membership comes from a real MembershipTable driven with explicit times.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hogshard.proto.errors import ConfigError, ErrorCode
from hogshard.proto.policy import (
    AsyncPolicy,
    SSPPolicy,
    mean_rate_power,
    parse_policy,
    rate_rule_note,
)
from hogshard.scheduler.membership import MembershipTable

FAST = settings(deadline=None, max_examples=300)
clocks = st.dictionaries(st.text(min_size=1, max_size=6), st.integers(0, 10_000), max_size=8)


# ---------------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["async", "ASYNC", "  async\n", "Async"])
def test_parse_async(spec: str) -> None:
    policy = parse_policy(spec)
    assert isinstance(policy, AsyncPolicy)
    assert policy.spec == "async"


@pytest.mark.parametrize(("spec", "staleness"), [("ssp:0", 0), ("ssp:3", 3), ("SSP:12", 12),
                                                 (" ssp:7 ", 7), ("ssp:007", 7)])
def test_parse_ssp(spec: str, staleness: int) -> None:
    policy = parse_policy(spec)
    assert isinstance(policy, SSPPolicy)
    assert policy.staleness == staleness
    assert policy.spec == f"ssp:{staleness}"


@pytest.mark.parametrize("spec", ["async", "ssp:0", "ssp:5"])
def test_spec_round_trips(spec: str) -> None:
    """The spec a scheduler sends in its register reply parses back into the same policy."""
    policy = parse_policy(spec)
    assert parse_policy(policy.spec) == policy


@FAST
@given(st.integers(0, 10**6))
def test_ssp_spec_round_trips_any_staleness(staleness: int) -> None:
    policy = parse_policy(f"ssp:{staleness}")
    assert policy.staleness == staleness
    assert parse_policy(policy.spec) == policy


@pytest.mark.parametrize("spec", ["ssp", "ssp:", "ssp:-1", "ssp:x", "ssp:1.5", "ssp: 3"])
def test_bad_ssp_names_the_accepted_form(spec: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_policy(spec)
    message = info.value.message
    assert repr(spec) in message  # the offending spec, quoted
    assert "ssp:" in message  # an example of the accepted form, e.g. 'ssp:2'
    assert "integer" in message
    assert info.value.code is ErrorCode.MALFORMED


@pytest.mark.parametrize("spec", ["bogus", "", "asynchronous", "async:1", "sspp:1", "bsp"])
def test_unknown_policy_lists_the_accepted_forms(spec: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_policy(spec)
    message = info.value.message
    assert repr(spec) in message
    assert "async" in message and "ssp:S" in message


def test_superscript_digit_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        parse_policy("ssp:\u00b2")


# ---------------------------------------------------------------------------------------------
# the SSP gate
# ---------------------------------------------------------------------------------------------


def test_docstring_example() -> None:
    policy = parse_policy("ssp:2")
    assert policy.may_pull(clock=5, live_clocks={"w0": 3, "w1": 4})
    assert not policy.may_pull(clock=6, live_clocks={"w0": 3, "w1": 4})


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_gate_boundary(staleness: int) -> None:
    """A worker that finished c steps pulls iff the slowest live worker finished >= c - S."""
    policy = SSPPolicy(staleness)
    slowest = 10
    live = {"worker-0": slowest, "worker-1": slowest + 4}
    assert policy.may_pull(slowest + staleness, live)
    assert not policy.may_pull(slowest + staleness + 1, live)
    assert policy.may_pull(0, live)


def test_ssp0_is_lockstep() -> None:
    policy = parse_policy("ssp:0")
    assert policy.may_pull(4, {"a": 4, "b": 4})
    assert not policy.may_pull(5, {"a": 5, "b": 4})


def test_empty_live_set_never_blocks() -> None:
    assert SSPPolicy(0).may_pull(10**9, {})


def test_requester_own_clock_counts() -> None:
    """The server adds the requester's own clock; alone, a worker is never held back."""
    assert SSPPolicy(0).may_pull(7, {"worker-0": 7})


@FAST
@given(staleness=st.integers(0, 50), clock=st.integers(0, 10_000), live=clocks)
def test_gate_matches_definition(staleness: int, clock: int, live: dict[str, int]) -> None:
    expected = not live or min(live.values()) >= clock - staleness
    assert SSPPolicy(staleness).may_pull(clock, live) is expected


@FAST
@given(staleness=st.integers(0, 20), clock=st.integers(0, 1000), live=clocks)
def test_gate_is_monotone(staleness: int, clock: int, live: dict[str, int]) -> None:
    """Allowed at clock c implies allowed at any smaller clock and for any larger staleness."""
    policy = SSPPolicy(staleness)
    if policy.may_pull(clock, live):
        assert policy.may_pull(max(0, clock - 1), live)
        assert SSPPolicy(staleness + 1).may_pull(clock, live)


@FAST
@given(clock=st.integers(0, 10**6), live=clocks)
def test_async_always_allows(clock: int, live: dict[str, int]) -> None:
    assert parse_policy("async").may_pull(clock, live) is True


def test_dead_worker_leaves_the_gate() -> None:
    """The slow worker is declared dead; it leaves live_clocks and the others go on."""
    members = MembershipTable(heartbeat_timeout=5.0)
    fast = members.register("worker", "", now=0.0)
    slow = members.register("worker", "", now=0.0)
    fast.clock, slow.clock = 9, 2
    policy = parse_policy("ssp:3")
    assert not policy.may_pull(9, members.live_clocks())
    members.touch(fast.node_id, now=6.0)
    assert [m.node_id for m in members.expire(now=6.0)] == [slow.node_id]
    assert members.live_clocks() == {fast.node_id: 9}
    assert policy.may_pull(9, members.live_clocks())


def test_leaving_worker_leaves_the_gate() -> None:
    members = MembershipTable(heartbeat_timeout=5.0)
    fast = members.register("worker", "", now=0.0)
    slow = members.register("worker", "", now=0.0)
    fast.clock, slow.clock = 4, 0
    policy = parse_policy("ssp:1")
    assert not policy.may_pull(4, members.live_clocks())
    members.leave(slow.node_id)
    assert policy.may_pull(4, members.live_clocks())


def test_all_workers_dead_unblocks() -> None:
    members = MembershipTable(heartbeat_timeout=1.0)
    members.register("worker", "", now=0.0).clock = 0
    members.expire(now=2.0)
    assert members.live_clocks() == {}
    assert parse_policy("ssp:0").may_pull(100, members.live_clocks())


def test_servers_do_not_count_as_workers() -> None:
    members = MembershipTable(heartbeat_timeout=5.0)
    members.register("server", "inproc://s0", now=0.0)  # clock 0, but not a worker
    members.register("worker", "", now=0.0).clock = 8
    assert parse_policy("ssp:0").may_pull(8, members.live_clocks())


# ---------------------------------------------------------------------------------------------
# hardsync, softsync:N and modifiers
# ---------------------------------------------------------------------------------------------


def test_parse_hardsync_and_softsync() -> None:
    from hogshard.proto.policy import HardSyncPolicy, SoftSyncPolicy

    hard = parse_policy(" HardSync ")
    assert isinstance(hard, HardSyncPolicy) and hard.waits_for_apply and hard.spec == "hardsync"
    assert hard.group_size(5) == 5 and hard.group_size(0) == 1
    soft = parse_policy("softsync:4")
    assert isinstance(soft, SoftSyncPolicy) and soft.n == 4 and not soft.waits_for_apply
    assert [soft.group_size(lam) for lam in (0, 1, 3, 4, 8, 9)] == [1, 1, 1, 1, 2, 2]
    assert parse_policy("async").group_size(8) == 1 and parse_policy("ssp:1").group_size(8) == 1


@pytest.mark.parametrize(("spec", "canonical"), [
    ("softsync:4+lr=staleness", "softsync:4+lr=staleness"),
    ("softsync:4+maxstale=3+lr=staleness", "softsync:4+lr=staleness+maxstale=3"),
    ("softsync:15+lr=mean", "softsync:15+lr=mean"),
    ("ssp:2+maxstale=9+LR=MEAN", "ssp:2+lr=mean+maxstale=9"),
    ("HARDSYNC+DC=0.5", "hardsync+dc=0.5"),
    ("async+dc=0.1234567", "async+dc=0.1234567"),
    ("ssp:2+dc=1e-5+maxstale=0", "ssp:2+dc=1e-05+maxstale=0"),
    ("async+dc=0", "async"),
    ("async+dc=.25", "async+dc=0.25"),
])
def test_modifiers_parse_to_a_canonical_spec_that_round_trips(spec: str, canonical: str) -> None:
    policy = parse_policy(spec)
    assert policy.spec == canonical
    assert parse_policy(policy.spec) == policy


def test_modifier_values() -> None:
    policy = parse_policy("softsync:2+lr=staleness+dc=0.75+maxstale=4")
    m = policy.modifiers
    assert (m.lr_staleness, m.dc_lambda, m.max_staleness) == (True, 0.75, 4)
    assert [m.lr_scale(s) for s in (0, 1, 2, 8)] == [1.0, 1.0, 0.5, 0.125]
    assert m.accepts(4) and not m.accepts(5)
    plain = parse_policy("async").modifiers
    assert plain.lr_scale(100) == 1.0 and plain.accepts(10**9)


def test_lr_mean_divides_by_the_mean_staleness_not_the_gradients_own() -> None:
    m = parse_policy("softsync:4+lr=mean").modifiers
    assert m.lr_mean and not m.lr_staleness
    assert m.lr_scale(0, mean_staleness=4.0) == 0.25  # a fresh gradient is scaled too
    assert m.lr_scale(9, mean_staleness=2.5) == 0.4
    assert m.lr_scale(3, mean_staleness=0.5) == 1.0  # never above the base rate


@FAST
@given(st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False))
def test_dc_lambda_round_trips_exactly(lam: float) -> None:
    policy = parse_policy(f"async+dc={lam!r}")
    assert policy.modifiers.dc_lambda == lam
    assert parse_policy(policy.spec) == policy


@pytest.mark.parametrize("spec", [
    "softsync", "softsync:", "softsync:0", "softsync:-2", "softsync:x", "hardsync:2",
    "async+", "async+lr", "async+lr=1", "async+lr=staleness+lr=staleness", "async+dc",
    "async+lr=staleness+lr=mean", "async+lr=means", "async+lr=mean+lr=mean",
    "async+dc=-1", "async+dc=nan", "async+dc=inf", "async+dc=1e400", "async+dc=1_0",
    "async+dc=+1", "async+maxstale", "async+maxstale=-1", "async+maxstale=1.5", "async+bogus=1",
    "async+maxstale=1+maxstale=2",
])
def test_bad_specs_are_config_errors_naming_the_spec(spec: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_policy(spec)
    assert repr(spec) in info.value.message
    assert info.value.code is ErrorCode.MALFORMED


def test_bad_modifier_lists_the_accepted_modifiers() -> None:
    with pytest.raises(ConfigError, match=r"lr=staleness.*dc=LAMBDA.*maxstale=K"):
        parse_policy("async+speed=11")


def test_non_string_spec_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="string"):
        parse_policy(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(("spec", "rule", "law"), [
    ("softsync:15+lr=mean", "adam", "sqrt(<staleness>)"),
    ("softsync:30+lr=mean", "adagrad", "sqrt(<staleness>)"),
    ("softsync:15+lr=mean", "sgd", "by <staleness>"), ("async+lr=mean", "momentum", "by <staleness>"),
    ("softsync:15+lr=staleness", "adam", "its gradient's staleness"), ("hardsync", "adam", None),
])
def test_rate_rule_note_says_how_the_modifier_scales_the_rule(spec: str, rule: str,
                                                               law: str | None) -> None:
    note = rate_rule_note(spec, rule)
    assert (note is None) == (law is None)
    if law is not None:
        assert note is not None and rule in note and law in note


@pytest.mark.parametrize(("rule", "power"), [("sgd", 1.0), ("momentum", 1.0), ("adam", 0.5),
                                             ("adamw", 0.5), ("adagrad", 0.5), ("rmsprop", 0.5)])
def test_mean_rate_power_is_linear_for_sgd_and_square_root_for_adaptive_rules(
        rule: str, power: float) -> None:
    assert mean_rate_power(rule) == power
    m = parse_policy("softsync:4+lr=mean").modifiers
    assert m.lr_scale(0, mean_staleness=16.0, power=mean_rate_power(rule)) == 16.0 ** -power


def test_lr_staleness_in_a_short_job_counts_at_least_the_mean() -> None:
    m = parse_policy("async+lr=staleness").modifiers
    assert m.lr_scale(1, mean_staleness=4.0) == 1.0  # all live: the gradient's own
    assert m.lr_scale(1, mean_staleness=4.0, short=True) == 0.25
    assert m.lr_scale(8, mean_staleness=4.0, short=True) == 0.125
    assert m.lr_scale(0, mean_staleness=0.5, short=True) == 1.0


@pytest.mark.parametrize(("spec", "live", "bound"), [
    ("hardsync", 8, 0), ("ssp:0", 3, 2), ("ssp:2", 3, 10), ("ssp:2", 1, 0), ("ssp:1", 0, 0),
    ("async", 8, None), ("softsync:4", 8, None), ("async+maxstale=5", 8, 5),
    ("ssp:2+maxstale=4", 3, 4), ("ssp:2+maxstale=40", 3, 10),
])
def test_staleness_bound(spec: str, live: int, bound: int | None) -> None:
    assert parse_policy(spec).staleness_bound(live) == bound
