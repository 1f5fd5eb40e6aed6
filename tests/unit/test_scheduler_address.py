"""The scheduler says which endpoint it bound, not only the address to reach it by."""

from __future__ import annotations

import pytest

from hogshard.scheduler.service import Scheduler


@pytest.mark.parametrize("bind, bound_host", [("tcp://0.0.0.0:0", "0.0.0.0"),
                                              ("tcp://127.0.0.1:0", "127.0.0.1")])
def test_listening_names_the_bound_endpoint(bind: str, bound_host: str) -> None:
    scheduler = Scheduler(bind)
    try:
        port = scheduler.address.rsplit(":", 1)[1]
        assert scheduler.address == f"tcp://127.0.0.1:{port}"
        assert scheduler.listening.startswith(f"tcp://{bound_host}:{port}")
        if bound_host == "0.0.0.0":
            assert f"(from this host: tcp://127.0.0.1:{port})" in scheduler.listening
    finally:
        scheduler.stop()
        scheduler.serve_forever()  # returns at once, closing the socket and the context
