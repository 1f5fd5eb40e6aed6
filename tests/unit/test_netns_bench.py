"""benchmarks/netns.py and benchmarks/pushpull_links.py: the pure parts (rates, bucket sizes,
stale namespace names, the commands that make a pair, how chunks are spread over links)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import netns  # noqa: E402  (benchmarks/netns.py)
from pushpull_links import lanes  # noqa: E402  (benchmarks/pushpull_links.py)


def test_rates_in_tc_units_and_a_bad_rate_is_refused():
    assert netns.rate_bits("10gbit") == 10e9
    assert netns.rate_bits("2.5Gbit") == 2.5e9
    assert netns.rate_bits("100mbps") == 800e6
    with pytest.raises(ValueError, match="10gbit"):
        netns.rate_bits("fast")
    with pytest.raises(ValueError):
        netns.NamespacePair(rate="10 gigs")


def test_burst_holds_four_ms_at_the_rate_and_at_least_one_mib():
    assert netns.burst_bytes("100mbit") == 1 << 20
    assert netns.burst_bytes("100gbit") == 50_000_000


def test_only_namespaces_of_gone_processes_are_stale():
    listing = ("hsbench-11-srv (id: 0)\nhsbench-11-cli (id: 1)\nhsbench-12-srv\n"
               "hsbench-x-srv\nmine-13-srv\n")
    assert netns.stale_namespaces(listing, lambda pid: pid == 12) == ["hsbench-11-srv",
                                                                     "hsbench-11-cli"]
    assert netns.stale_namespaces("", lambda pid: False) == []


def test_setup_commands_address_both_ends_and_shape_both_directions():
    pair = netns.NamespacePair(rate="1gbit", mtu=9000, tag=42)
    assert (pair.server_ns, pair.client_ns) == ("hsbench-42-srv", "hsbench-42-cli")
    commands = [" ".join(c) for c in pair.setup_commands()]
    assert commands[0].startswith("ip link add veth-srv netns hsbench-42-srv type veth peer")
    assert f"ip -n hsbench-42-srv addr add {netns.SERVER_IP}/24 dev veth-srv" in commands
    assert f"ip -n hsbench-42-cli addr add {netns.CLIENT_IP}/24 dev veth-cli" in commands
    assert sum("tbf rate 1gbit" in c for c in commands) == 2
    assert sum("mtu 9000" in c for c in commands) == 2
    plain = [" ".join(c) for c in netns.NamespacePair(tag=1).setup_commands()]
    assert not any("tbf" in c or "mtu" in c for c in plain)
    with pytest.raises(ValueError, match="mtu"):
        netns.NamespacePair(mtu=10)


def test_lanes_are_runs_of_neighbouring_chunks_with_even_shares():
    chunks = [(i * 4, 4) for i in range(16)]
    runs = lanes(chunks, 4)
    assert [len(r) for r in runs] == [4, 4, 4, 4]
    assert [c for run in runs for c in run] == chunks
    assert lanes(chunks[:3], 2) == [chunks[:2], chunks[2:3]]
    assert lanes(chunks[:1], 4) == [chunks[:1]]
    with pytest.raises(ValueError):
        lanes(chunks, 0)
