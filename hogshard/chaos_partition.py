"""Network partitions between two processes of one host, for the fault storm: every TCP packet
between exactly those two processes is dropped by the kernel (iptables), in both directions,
while each keeps talking to everyone else.

``hogshard launch`` runs every role in one network namespace, over loopback, so a partition
cannot be a link taken down between namespaces. It is made of two kinds of rule in a chain of
its own (``HSCHAOS-<pid>``, jumped to from ``OUTPUT``; on loopback every packet passes
``OUTPUT`` once, by its sender):

- the connections that exist when the cut begins: their port pairs, found from
  ``/proc/<pid>/fd`` and ``/proc/net/tcp{,6}``, dropped both ways;
- the connections either process opens while cut: each is moved into a cgroup (v2) of its own
  for the cut, and a new socket from that cgroup to any port the other listens on is dropped
  (a socket belongs to the cgroup its process was in when the socket was made, so the first
  kind of rule is needed as well).

Healing deletes the rules and moves the processes back. Needs root, ``iptables`` with the
``cgroup`` match and a cgroup v2 hierarchy (``/sys/fs/cgroup`` or ``/sys/fs/cgroup/unified``).

Example::

    with Partitions() as cuts:
        cut = cuts.cut(server_pid, scheduler_pid)
        time.sleep(5.0)
        cuts.heal(cut)
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CHAIN_PREFIX = "HSCHAOS-"
CGROUP_PREFIX = "hschaos-"
_LISTEN = "0A"


class PartitionUnavailable(RuntimeError):
    """Partitions cannot be made here (not root, no iptables, no cgroup v2, or a rule failed)."""


def cgroup2_root() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted, or None."""
    for path in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if (path / "cgroup.procs").exists() and (path / "cgroup.max.depth").exists():
            return path
    return None


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def tcp_sockets(pid: int) -> list[tuple[int, int, str]]:
    """(local port, remote port, state) of each TCP socket ``pid`` holds (state ``0A``:
    listening)."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and int(cols[9]) in inodes:
                found.append((int(cols[1].rsplit(":", 1)[1], 16),
                              int(cols[2].rsplit(":", 1)[1], 16), cols[3]))
    return found


def shared_connections(a: int, b: int) -> set[tuple[int, int]]:
    """Port pairs (a's port, b's port) of the TCP connections between processes ``a`` and
    ``b`` (over one host's loopback, a port names one socket)."""
    b_ports = {local for local, _, state in tcp_sockets(b) if state != _LISTEN}
    return {(local, remote) for local, remote, state in tcp_sockets(a)
            if state != _LISTEN and remote in b_ports}


def listening_ports(pid: int) -> set[int]:
    return {local for local, _, state in tcp_sockets(pid) if state == _LISTEN}


@dataclass
class Cut:
    """One partition between two processes: the rules that make it, the cgroups they were
    moved into."""

    a: int
    b: int
    rules: list[list[str]] = field(default_factory=list)
    cgroups: dict[int, Path] = field(default_factory=dict)
    homes: dict[int, Path] = field(default_factory=dict)  # the cgroup each was in before


class Partitions:
    """Cuts between pairs of processes; a context manager that heals every cut it made and
    removes its chain (on errors too)."""

    def __init__(self) -> None:
        self.chain = f"{CHAIN_PREFIX}{os.getpid()}"[:28]
        self._cuts: list[Cut] = []
        self._root: Path | None = None

    @staticmethod
    def unavailable() -> str | None:
        """Why partitions cannot be made here, or None."""
        if os.geteuid() != 0:
            return "partitions need root (iptables, cgroups)"
        if shutil.which("iptables") is None:
            return "no iptables command"
        if cgroup2_root() is None:
            return "no cgroup v2 hierarchy (the cgroup match needs one)"
        return None

    def _iptables(self, *args: str, check: bool = True) -> bool:
        done = subprocess.run(["iptables", "-w", "5", *args], capture_output=True, text=True,
                              timeout=30)
        if check and done.returncode != 0:
            raise PartitionUnavailable(f"iptables {' '.join(args)}: {done.stderr.strip()}")
        return done.returncode == 0

    def __enter__(self) -> Partitions:
        why = self.unavailable()
        if why is not None:
            raise PartitionUnavailable(why)
        self._root = cgroup2_root()
        self._remove_chain()
        self._iptables("-N", self.chain)
        self._iptables("-I", "OUTPUT", "-j", self.chain)
        return self

    def __exit__(self, *exc: object) -> None:
        for cut in list(self._cuts):
            self.heal(cut)
        self._remove_chain()

    def _remove_chain(self) -> None:
        while self._iptables("-D", "OUTPUT", "-j", self.chain, check=False):
            pass
        self._iptables("-F", self.chain, check=False)
        self._iptables("-X", self.chain, check=False)

    def _move(self, pid: int, cgroup: Path) -> None:
        try:
            (cgroup / "cgroup.procs").write_text(str(pid))
        except OSError as err:  # gone already: nothing of it to cut
            log.info("pid %d not moved into %s: %s", pid, cgroup, err)

    def _cgroup_of(self, pid: int) -> Path:
        assert self._root is not None
        try:
            for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
                if line.startswith("0::"):
                    return self._root / line[3:].strip().lstrip("/")
        except OSError:
            pass
        return self._root

    def cut(self, a: int, b: int) -> Cut:
        """Drop every packet between processes ``a`` and ``b`` until :meth:`heal`."""
        assert self._root is not None, "use Partitions as a context manager"
        cut = Cut(a, b)
        self._cuts.append(cut)
        tag = secrets.token_hex(3)
        for pid in (a, b):
            cgroup = self._root / f"{CGROUP_PREFIX}{tag}-{pid}"
            cgroup.mkdir()
            cut.cgroups[pid] = cgroup
            cut.homes[pid] = self._cgroup_of(pid)
            self._move(pid, cgroup)
        for mine, other in ((a, b), (b, a)):
            path = str(cut.cgroups[mine].relative_to(self._root))
            for port in sorted(listening_ports(other)):
                cut.rules.append(["-m", "cgroup", "--path", path, "-p", "tcp", "--dport",
                                  str(port), "-j", "DROP"])
        for port_a, port_b in sorted(shared_connections(a, b)):
            cut.rules += [["-p", "tcp", "--sport", str(port_a), "--dport", str(port_b), "-j",
                           "DROP"],
                          ["-p", "tcp", "--sport", str(port_b), "--dport", str(port_a), "-j",
                           "DROP"]]
        for rule in cut.rules:
            self._iptables("-A", self.chain, *rule)
        log.info("cut %d from %d: %d rules", a, b, len(cut.rules))
        return cut

    def heal(self, cut: Cut) -> None:
        """Undo ``cut``: its rules deleted, its processes back in the root cgroup."""
        assert self._root is not None
        for rule in cut.rules:
            self._iptables("-D", self.chain, *rule, check=False)
        for pid, cgroup in cut.cgroups.items():
            try:
                for moved in (cgroup / "cgroup.procs").read_text().split():
                    self._move(int(moved), cut.homes.get(pid, self._root))
                cgroup.rmdir()
            except OSError as err:
                log.warning("cgroup %s of pid %d not removed: %s", cgroup, pid, err)
        if cut in self._cuts:
            self._cuts.remove(cut)
        log.info("healed %d from %d", cut.a, cut.b)
