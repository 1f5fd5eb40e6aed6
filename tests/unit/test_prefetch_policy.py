"""Which consistency policies allow ``PSOptimizer(prefetch=True)`` (weights one step older)."""

from __future__ import annotations

import pytest

from hogshard.proto.errors import ConfigError
from hogshard.worker.optimizer import check_prefetch


@pytest.mark.parametrize("policy", ["async", "softsync:2", "ssp:1", "ssp:3+lr=staleness"])
def test_prefetch_is_allowed_where_staleness_is(policy: str) -> None:
    check_prefetch(policy)


@pytest.mark.parametrize("policy", ["hardsync", "ssp:0"])
def test_prefetch_is_refused_where_each_step_needs_the_freshest_weights(policy: str) -> None:
    with pytest.raises(ConfigError, match="one step older"):
        check_prefetch(policy)
