"""Which sockets a worker's channel keeps when it learns the live servers: a server found
dead that the map still gives chunks keeps its socket (the job waits for its rank to come
back, and requests to it wait too); one that holds nothing, or that came back as a new
process, loses it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hogshard.proto.config import ClientSettings, ShmSettings
from hogshard.worker.channel import Channel
from hogshard.worker.shm import ShmLink


def _server(rank: int, incarnation: int = 1) -> dict[str, object]:
    return {"rank": rank, "address": f"tcp://127.0.0.1:{9000 + rank}",
            "incarnation": incarnation}


@pytest.fixture
def channel() -> Iterator[Channel]:
    channel = Channel(ClientSettings(scheduler="tcp://127.0.0.1:9999"), None, None,
                      ShmLink(ShmSettings(), "test-host"))
    channel.connect([_server(0), _server(1), _server(2)])
    try:
        yield channel
    finally:
        channel.close()


def test_a_dead_server_that_holds_chunks_keeps_its_socket(channel: Channel) -> None:
    links = dict(channel.links)
    channel.connect([_server(0), _server(2)], holding={0, 1})
    assert channel.ranks == [0, 1, 2] and channel.links == links


def test_a_dead_server_that_holds_nothing_loses_its_socket(channel: Channel) -> None:
    channel.connect([_server(0), _server(1)], holding={0, 1})  # server 2 was drained
    assert channel.ranks == [0, 1] and not channel.reaches(2)


def test_a_server_back_as_a_new_process_gets_a_new_socket(channel: Channel) -> None:
    links = dict(channel.links)
    channel.connect([_server(0), _server(1, incarnation=2), _server(2)], holding={0, 1, 2})
    assert channel.ranks == [0, 1, 2] and channel.links[1] == links[1] + 1
    assert channel.links[0] == links[0]
