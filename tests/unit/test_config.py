"""Unit tests of hogshard.proto.config: ``HOGSHARD_*`` variable names and ClientSettings.from_env."""

from __future__ import annotations

import dataclasses

import pytest

from hogshard.proto.config import (
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_SCHEDULER,
    ENV_PREFIX,
    ClientSettings,
    env_name,
)
from hogshard.proto.errors import ConfigError, ErrorCode


@pytest.mark.parametrize(
    ("option", "variable"),
    [
        ("heartbeat-timeout", "HOGSHARD_HEARTBEAT_TIMEOUT"),
        ("scheduler", "HOGSHARD_SCHEDULER"),
        ("max-message-bytes", "HOGSHARD_MAX_MESSAGE_BYTES"),
        ("request_timeout", "HOGSHARD_REQUEST_TIMEOUT"),  # field names map the same way
        ("Num-Workers", "HOGSHARD_NUM_WORKERS"),
    ],
)
def test_env_name(option: str, variable: str) -> None:
    assert env_name(option) == variable
    assert variable.startswith(ENV_PREFIX)


def test_defaults() -> None:
    settings = ClientSettings.from_env({})
    assert settings == ClientSettings()
    assert settings.scheduler == DEFAULT_SCHEDULER == "tcp://127.0.0.1:7000"
    assert settings.rank is None
    assert settings.num_workers == 1
    assert settings.request_timeout == 300.0
    assert settings.connect_timeout == 60.0
    assert DEFAULT_HEARTBEAT_INTERVAL < DEFAULT_HEARTBEAT_TIMEOUT


def test_every_field_is_read() -> None:
    env = {
        "HOGSHARD_SCHEDULER": "tcp://10.0.0.1:7000",
        "HOGSHARD_RANK": "3",
        "HOGSHARD_NUM_WORKERS": "8",
        "HOGSHARD_REQUEST_TIMEOUT": "12.5",
        "HOGSHARD_CONNECT_TIMEOUT": "7",
        "HOGSHARD_CODEC": "topk:0.01",
        "HOGSHARD_KEYS": "/etc/hogshard/keys",
        "HOGSHARD_MAX_IN_FLIGHT": "16",
        "HOGSHARD_LOG_LEVEL": "debug",
        "HOGSHARD_LOG_FORMAT": "json",
    }
    settings = ClientSettings.from_env(env)
    assert settings == ClientSettings("tcp://10.0.0.1:7000", 3, 8, 12.5, 7.0, "topk:0.01",
                                      "/etc/hogshard/keys", 16, "debug", "json")
    assert type(settings.rank) is int and type(settings.num_workers) is int
    assert type(settings.request_timeout) is float and type(settings.connect_timeout) is float
    # every field has a variable
    assert {env_name(f.name) for f in dataclasses.fields(ClientSettings)} == set(env)


def test_a_bad_log_format_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="HOGSHARD_LOG_FORMAT='xml'"):
        ClientSettings.from_env({"HOGSHARD_LOG_FORMAT": "xml"})


def test_whitespace_is_stripped() -> None:
    settings = ClientSettings.from_env(
        {"HOGSHARD_RANK": " 2 ", "HOGSHARD_REQUEST_TIMEOUT": "\t1e3\n",
         "HOGSHARD_SCHEDULER": "  ipc:///tmp/s  "}
    )
    assert (settings.rank, settings.request_timeout, settings.scheduler) == (2, 1000.0,
                                                                              "ipc:///tmp/s")


@pytest.mark.parametrize("blank", ["", "   ", "\n"])
def test_blank_values_mean_default(blank: str) -> None:
    env = {"HOGSHARD_RANK": blank, "HOGSHARD_REQUEST_TIMEOUT": blank, "HOGSHARD_SCHEDULER": blank}
    assert ClientSettings.from_env(env) == ClientSettings()


def test_other_variables_are_ignored() -> None:
    env = {"HOGSHARD_POLICY": "ssp:2", "HOGSHARD_UNKNOWN": "x", "RANK": "5", "hogshard_rank": "4"}
    assert ClientSettings.from_env(env) == ClientSettings()


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for field in dataclasses.fields(ClientSettings):
        monkeypatch.delenv(env_name(field.name), raising=False)
    monkeypatch.setenv("HOGSHARD_RANK", "6")
    monkeypatch.setenv("HOGSHARD_SCHEDULER", "tcp://sched:7000")
    settings = ClientSettings.from_env()
    assert (settings.rank, settings.scheduler) == (6, "tcp://sched:7000")


@pytest.mark.parametrize(
    ("variable", "raw", "expected"),
    [
        ("HOGSHARD_RANK", "x", "an integer"),
        ("HOGSHARD_RANK", "1.0", "an integer"),
        ("HOGSHARD_RANK", "0x2", "an integer"),
        ("HOGSHARD_NUM_WORKERS", "four", "an integer"),
        ("HOGSHARD_NUM_WORKERS", "2 3", "an integer"),
        ("HOGSHARD_REQUEST_TIMEOUT", "soon", "a number"),
        ("HOGSHARD_REQUEST_TIMEOUT", "1,5", "a number"),
        ("HOGSHARD_CONNECT_TIMEOUT", "60s", "a number"),
    ],
)
def test_bad_values_name_the_variable(variable: str, raw: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        ClientSettings.from_env({variable: raw})
    message = info.value.message
    assert message.startswith(f"{variable}={raw!r}")
    assert expected in message
    assert info.value.code is ErrorCode.MALFORMED


def test_settings_are_frozen() -> None:
    settings = ClientSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.rank = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("variable", "raw"),
    [
        ("HOGSHARD_REQUEST_TIMEOUT", "nan"),
        ("HOGSHARD_REQUEST_TIMEOUT", "inf"),
        ("HOGSHARD_CONNECT_TIMEOUT", "-1"),
        ("HOGSHARD_NUM_WORKERS", "0"),
    ],
)
def test_out_of_range_values_are_refused(variable: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=variable):
        ClientSettings.from_env({variable: raw})


def test_max_in_flight_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="HOGSHARD_MAX_IN_FLIGHT=0: expected >= 1"):
        ClientSettings.from_env({"HOGSHARD_MAX_IN_FLIGHT": "0"})
