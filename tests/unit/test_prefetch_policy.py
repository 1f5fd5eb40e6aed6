"""Which consistency policies allow ``PSOptimizer(prefetch=True)`` (weights one step older)
and ``RemoteEmbeddingBag(pipeline="stale")`` (rows one step older)."""

from __future__ import annotations

import pytest

from hogshard.proto.errors import ConfigError
from hogshard.worker.embedding import check_pipeline
from hogshard.worker.optimizer import check_prefetch


@pytest.mark.parametrize("policy", ["async", "softsync:2", "ssp:1", "ssp:3+lr=staleness"])
def test_prefetch_is_allowed_where_staleness_is(policy: str) -> None:
    check_prefetch(policy)


@pytest.mark.parametrize("policy", ["hardsync", "ssp:0"])
def test_prefetch_is_refused_where_each_step_needs_the_freshest_weights(policy: str) -> None:
    with pytest.raises(ConfigError, match="one step older"):
        check_prefetch(policy)


@pytest.mark.parametrize("policy", ["async", "softsync:2", "ssp:1"])
def test_stale_row_pipeline_is_allowed_where_staleness_is(policy: str) -> None:
    check_pipeline("stale", policy)
    check_pipeline("exact", policy)


@pytest.mark.parametrize("policy", ["hardsync", "ssp:0"])
def test_stale_row_pipeline_is_refused_where_exact_rows_are_promised(policy: str) -> None:
    with pytest.raises(ConfigError, match="one step older"):
        check_pipeline("stale", policy)
    check_pipeline("exact", policy)  # exact rows: allowed under every policy
    check_pipeline(None, policy)


def test_an_unknown_pipeline_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="pipeline must be"):
        check_pipeline("eager", "async")
