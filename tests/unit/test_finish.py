"""``PSClient.finish`` and the client as a context manager, on a client whose barrier, pulls
and close are recorded (no sockets): the order of the three, the registered optimizers pulled,
and a block that raises only leaving the job."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hogshard.worker.client import FINISH_BARRIER, PSClient


def recording_client(calls: list[tuple], fail_barrier: bool = False) -> PSClient:
    client = object.__new__(PSClient)
    client._closed = False
    client.optimizers = []
    client.settings = SimpleNamespace(num_workers=3)  # type: ignore[assignment]

    def barrier(name: str, timeout: float | None = None, ranks: int | None = None) -> None:
        calls.append(("barrier", name, timeout, ranks))
        if fail_barrier:
            raise TimeoutError("a rank never came")

    def close(leave: bool = True) -> None:
        calls.append(("close",))
        client._closed = True

    client.barrier = barrier  # type: ignore[method-assign]
    client.close = close  # type: ignore[method-assign]
    return client


class Opt:
    def __init__(self, name: str, calls: list[tuple]) -> None:
        self.name, self.calls = name, calls

    def pull(self) -> None:
        self.calls.append(("pull", self.name))


def test_finish_waits_for_every_rank_then_pulls_every_optimizer_then_leaves() -> None:
    calls: list[tuple] = []
    client = recording_client(calls)
    for name in ("dense", "head"):
        client.register_optimizer(Opt(name, calls))
    client.finish(timeout=5.0)
    client.finish()  # a second call does nothing
    assert calls == [("barrier", FINISH_BARRIER, 5.0, 3), ("pull", "dense"), ("pull", "head"),
                     ("close",)]


def test_a_block_that_ends_normally_finishes_and_one_that_raises_only_leaves() -> None:
    calls: list[tuple] = []
    with recording_client(calls) as client:
        client.register_optimizer(Opt("dense", calls))
    assert [c[0] for c in calls] == ["barrier", "pull", "close"]
    calls.clear()
    with pytest.raises(RuntimeError), recording_client(calls) as client:
        client.register_optimizer(Opt("dense", calls))
        raise RuntimeError("training failed")
    assert calls == [("close",)]


def test_a_failed_wait_still_leaves_the_job() -> None:
    calls: list[tuple] = []
    client = recording_client(calls, fail_barrier=True)
    client.register_optimizer(Opt("dense", calls))
    with pytest.raises(TimeoutError):
        client.finish()
    assert [c[0] for c in calls] == ["barrier", "close"]
