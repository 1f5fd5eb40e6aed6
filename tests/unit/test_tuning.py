"""Malloc settings for the commands hogshard starts: filled in unless the user set any."""

from __future__ import annotations

from hogshard.launcher import worker_environment
from hogshard.tuning import MALLOC_ENVIRONMENT, MAX_MMAP_THRESHOLD, with_malloc_settings


def test_a_worker_command_gets_the_malloc_settings() -> None:
    env = worker_environment("tcp://127.0.0.1:7000", base={"PATH": "/bin"})
    assert {k: env[k] for k in MALLOC_ENVIRONMENT} == MALLOC_ENVIRONMENT
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(MAX_MMAP_THRESHOLD) == str(32 << 20)


def test_a_user_setting_keeps_glibc_defaults_for_the_rest() -> None:
    env = with_malloc_settings({"MALLOC_ARENA_MAX": "4"})
    assert env == {"MALLOC_ARENA_MAX": "4"}


def test_update_threads_by_default_only_where_cores_are_spare() -> None:
    from hogshard.tuning import default_update_threads, usable_cores

    assert [default_update_threads(c) for c in (1, 2, 4, 7)] == [0, 0, 0, 0]
    assert [default_update_threads(c) for c in (8, 12, 16, 64)] == [2, 3, 4, 4]
    assert default_update_threads() == default_update_threads(usable_cores()) >= 0
