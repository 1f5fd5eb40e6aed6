"""Parameter groups and live hyperparameters on the servers (proto/rule_groups.py,
ps/table_rules.py), the chunk planner cutting at groups, and partial pushes staged until their
step's closing push (ps/staging.py, DenseOps): no sockets."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from hogshard.proto.errors import ConfigError, HogshardError
from hogshard.proto.requests import Request
from hogshard.proto.rule_groups import check_table_rule, chunk_bounds
from hogshard.ps.dense import DenseStore
from hogshard.ps.staging import StagedPushes
from hogshard.ps.table_rules import TableRules
from hogshard.scheduler.placement import plan_dense_table
from tests.unit.test_dense_ops import F32, Parts, msg

TWO_GROUPS = {"rule": "sgd", "lr": 1.0, "groups": [{"start": 0, "lr": 1.0},
                                                   {"start": 2, "lr": 0.5}]}


@pytest.mark.parametrize(("groups", "match"), [
    ([{"start": 1}], "group 0: 'start' must be"),
    ([{"start": 0}, {"start": 0}], "group 1: 'start'"),
    ([{"start": 0}, {"start": 10}], "group 1: 'start'"),  # outside a table of 10
    ([{"start": 0}, {"start": 4, "betas": [0.9, 0.9]}], "parameter group 1 of rule 'sgd'"),
    ([{"start": 0, "lr": -1.0}], "lr must be"),
    ("all", "'groups' must list"),
    ([], "'groups' must list"),
])
def test_a_bad_group_is_refused_naming_it(groups: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_table_rule({"rule": "sgd", "groups": groups}, size=10)


def test_groups_are_filled_with_defaults_and_one_group_is_the_plain_rule() -> None:
    checked = check_table_rule({"rule": "adam", "groups": [{"start": 0},
                                                            {"start": 3, "lr": 0.1}]})
    assert checked["groups"][1]["lr"] == 0.1 and checked["groups"][1]["betas"] == [0.9, 0.999]
    assert checked["lr"] == 1e-3  # the first group's
    assert "groups" not in check_table_rule({"rule": "adam", "groups": [{"start": 0}]})


def test_no_chunk_straddles_a_group_start() -> None:
    bounds = chunk_bounds(20, 6, [0, 7, 8])
    assert bounds == [(0, 6), (6, 1), (7, 1), (8, 6), (14, 6)]
    chunks = plan_dense_table(20, 6, 2, [0, 7, 8])
    assert [(c.offset, c.length) for c in chunks] == bounds
    assert {c.server for c in chunks} == {0, 1}
    assert [(c.offset, c.length) for c in plan_dense_table(20, 6, 2)] == \
        [(0, 6), (6, 6), (12, 6), (18, 2)]


def test_rules_come_from_the_chunks_group_or_from_a_pushs_hyper() -> None:
    rules = TableRules(check_table_rule(TWO_GROUPS))
    assert [r.lr for r in rules.for_offsets([0, 1, 2, 3])] == [1.0, 1.0, 0.5, 0.5]
    live = rules.for_offsets([0, 2], [{"lr": 0.1, "momentum": 0.9}, {"lr": 0.2}])
    assert [(r.lr, r.momentum) for r in live] == [(0.1, 0.9), (0.2, 0.0)]
    again = rules.for_offsets([0, 2], [{"lr": 0.1, "momentum": 0.9}, {"lr": 0.2}])
    assert again[0] is live[0] and again[1] is live[1]  # built once
    for bad, match in [([{"lr": 0.1}], "one map of 'sgd' parameters per parameter group"),
                       ([{"lr": 0.1}, {"lr": 0.1, "rho": 1}], "parameter group 1"),
                       ([{"lr": 0.1}, {"lr": "fast"}], "lr must be"), ("lr", "'hyper'")]:
        with pytest.raises(ConfigError, match=match):
            rules.for_offsets([0], bad)


@pytest.fixture
def parts() -> Iterator[Parts]:
    context = zmq.Context()
    made = Parts(context)
    made.store = DenseStore()
    made.store.init("g", TWO_GROUPS, [(0, 0, 2), (1, 2, 2)], [np.zeros(2, F32)] * 2)
    made.ops._store = made.store
    yield made
    made.replicas.close()
    context.term()


def _push(parts: Parts, request_id: int, chunks: list[int], value: float, **fields: object
          ) -> None:
    parts.ops.push(Request(b"w", msg("push", request_id, "worker-0", chunks=chunks, clock=0,
                             versions=[0] * len(chunks), table="g",
                             arrays=[np.full(2, value, F32)] * len(chunks), **fields)))


def _weights(parts: Parts) -> list[float]:
    table = parts.store.table("g")
    return [float(v) for c in (0, 1) for v in table.chunks[c].weights]


def test_each_group_updates_with_its_own_or_the_pushed_hyperparameters(parts: Parts) -> None:
    _push(parts, 1, [0, 1], 1.0)
    assert _weights(parts) == [-1.0, -1.0, -0.5, -0.5]
    _push(parts, 2, [0, 1], 1.0, hyper=[{"lr": 0.25}, {"lr": 2.0}])
    assert _weights(parts) == [-1.25, -1.25, -2.5, -2.5]
    with pytest.raises(ConfigError, match="per parameter group"):  # one map for two groups
        _push(parts, 3, [0, 1], 1.0, hyper=[{"lr": 0.25}])
    assert _weights(parts) == [-1.25, -1.25, -2.5, -2.5]  # nothing changed


def test_a_partial_push_is_staged_until_its_steps_closing_push(parts: Parts) -> None:
    _push(parts, 1, [0, 1], 1.0, partial=True)
    assert parts.out.replies[-1] == (1, ({"staged": 2}, []))
    assert _weights(parts) == [0.0] * 4 and parts.ops.staging.chunks == 2
    _push(parts, 2, [1], 3.0, partial=True)  # sent again (changed after backward): replaces
    _push(parts, 3, [], 0.0, hyper=[{"lr": 0.5}, {"lr": 0.5}])  # the closing push, no chunk
    assert parts.out.replies[-1] == (3, ({"staleness": [0, 0]}, []))
    assert _weights(parts) == [-0.5, -0.5, -1.5, -1.5]  # with the closing push's hyper
    assert parts.ops.staging.chunks == 0


def test_a_staged_gradient_is_checked_when_its_step_closes(parts: Parts) -> None:
    _push(parts, 1, [0], float("nan"), partial=True)  # a GradScaler's overflow: staged
    assert parts.out.replies[-1] == (1, ({"staged": 1}, []))
    with pytest.raises(HogshardError, match="NaN"):
        _push(parts, 2, [1], 1.0)
    assert _weights(parts) == [0.0] * 4


def test_staged_gradients_of_a_skipped_step_or_a_gone_worker_are_dropped() -> None:
    staging = StagedPushes()
    g = [np.ones(2, F32)]
    staging.stage("w0", "t", 4, [0], g, [1])
    staging.stage("w0", "t", 5, [1], g, [1])  # step 4 was skipped
    assert staging.take("w0", "t", 5, [], [], []) == ([1], g, [1])
    staging.stage("w0", "t", 6, [0], g, [2])
    assert staging.take("w0", "t", 7, [], [], []) == ([], [], [])  # another step's
    staging.stage("w1", "t", 1, [0], g, [0])
    staging.keep_only({"w0"})
    assert staging.chunks == 0
