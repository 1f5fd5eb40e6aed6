"""Partitions in the fault storm (``hogshard/chaos_partition.py``, ``benchmarks/chaos.py
--kinds cut``): real packets dropped by the kernel between exactly two processes.

The first test checks the tool on three plain TCP processes: while a listener is cut from one
client, that client's open connection and any new one it opens get no answer, the other client
is served, and healing restores the open connection. The second runs a short storm of
partitions only under ``hogshard launch --replication 2 --respawn`` (seed 10: a server cut from
its backup for 3.4 s, then server 1 cut from the scheduler for 5.1 s, past the 3 s heartbeat
timeout, so that it is declared gone, its chunks promoted on server 0, while the workers still
reach it): the job finishes, acknowledged == applied exactly for every chunk (a fenced server
acknowledges nothing it does not keep), the cut-off server refused pushes once its lease ran out,
every checkpoint loads, and no rule or cgroup is left behind.

Both need root, iptables and a cgroup v2 hierarchy (CI has them); they skip otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hogshard.chaos_partition import CGROUP_PREFIX, CHAIN_PREFIX, Partitions, cgroup2_root

PYTHON = sys.executable
CHAOS = str(Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py")
pytestmark = pytest.mark.skipif(Partitions.unavailable() is not None,
                                reason=str(Partitions.unavailable()))

LISTENER = r"""
import socket, threading
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
print(srv.getsockname()[1], flush=True)
def echo(conn):
    while data := conn.recv(64):
        conn.sendall(data)
while True:
    threading.Thread(target=echo, args=(srv.accept()[0],), daemon=True).start()
"""
#: Reads commands on stdin: ``old T`` (echo on the open connection within T s), ``new T`` (a
#: new connection and an echo within T s); prints ``ok`` or ``fail`` for each.
CLIENT = r"""
import socket, sys
port = int(sys.argv[1])
old = socket.create_connection(("127.0.0.1", port))
print("ready", flush=True)
for line in sys.stdin:
    what, timeout = line.split()
    try:
        conn = old if what == "old" else socket.create_connection(("127.0.0.1", port),
                                                                   timeout=float(timeout))
        conn.settimeout(float(timeout)); conn.sendall(b"x"); ok = conn.recv(1) == b"x"
        if conn is not old:
            conn.close()
    except OSError:
        ok = False
    print("ok" if ok else "fail", flush=True)
"""


class Client:
    def __init__(self, port: int) -> None:
        self.popen = subprocess.Popen([PYTHON, "-c", CLIENT, str(port)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        assert self.readline() == "ready"

    def readline(self) -> str:
        assert self.popen.stdout is not None
        return self.popen.stdout.readline().strip()

    def ask(self, what: str, timeout: float) -> bool:
        assert self.popen.stdin is not None
        self.popen.stdin.write(f"{what} {timeout}\n")
        self.popen.stdin.flush()
        return self.readline() == "ok"


@pytest.fixture
def trio() -> Iterator[tuple[subprocess.Popen[str], Client, Client]]:
    started: list[subprocess.Popen[str]] = []
    try:
        listener = subprocess.Popen([PYTHON, "-c", LISTENER], stdout=subprocess.PIPE, text=True)
        started.append(listener)
        assert listener.stdout is not None
        port = int(listener.stdout.readline())
        a = Client(port)
        started.append(a.popen)
        b = Client(port)
        started.append(b.popen)
        yield listener, a, b
    finally:
        for popen in started:
            popen.kill()
            popen.wait(10)


def _leftovers() -> list[str]:
    rules = subprocess.run(["iptables", "-w", "5", "-S"], capture_output=True, text=True,
                           timeout=30).stdout
    root = cgroup2_root()
    cgroups = [p.name for p in root.iterdir() if p.name.startswith(CGROUP_PREFIX)] if root else []
    return [line for line in rules.splitlines() if CHAIN_PREFIX in line] + cgroups


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_cut_drops_exactly_one_pair_until_healed(
        trio: tuple[subprocess.Popen[str], Client, Client]) -> None:
    listener, a, b = trio
    assert a.ask("old", 5.0) and b.ask("old", 5.0)
    with Partitions() as cuts:
        cut = cuts.cut(listener.pid, a.popen.pid)
        assert not a.ask("old", 1.0), "the open connection still answers across the cut"
        assert not a.ask("new", 1.0), "a new connection got through the cut"
        assert b.ask("old", 5.0) and b.ask("new", 5.0), "the cut hit a third process"
        cuts.heal(cut)
        # TCP retransmits what the cut dropped: the echo comes back once the link heals
        assert a.ask("old", 20.0), "the open connection did not recover after the heal"
        assert a.ask("new", 5.0)
    assert _leftovers() == []


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240, method="signal")
def test_a_storm_of_partitions_loses_no_acknowledged_update(procs, tmp_path: Path) -> None:
    report = tmp_path / "storm.json"
    driver = procs.spawn("chaos", [PYTHON, CHAOS, "--seeds", "10", "--duration", "25",
                                   "--interval", "2", "--calm-runs", "0", "--min-steps", "300",
                                   "--kinds", "cut", "--workdir", str(tmp_path / "runs"),
                                   "--json", str(report)])
    code = driver.wait(220.0)
    storm = json.loads(report.read_text())["storms"][0]
    print(driver.tail(30))
    assert code == 0, (storm["verdict"], driver.tail(60))
    assert all(storm["verdict"].values()), storm["verdict"]
    plan = [(f["role"], f["rank"], f["hold"]) for f in storm["faults"][:2]]
    assert plan == [("server|server", 1, 3.36), ("server|scheduler", 1, 5.05)], plan
    assert storm["chunks"]["exact"] and storm["chunks"]["acked"] > 0, storm["chunks"]
    launch_log = (Path(storm["folder"]) / "launch.log").read_text()
    assert "server-1 is gone" in launch_log, "the cut-off server was never declared gone"
    assert "lease from the scheduler ran out" in launch_log, "the cut-off server was not fenced"
    assert _leftovers() == []
