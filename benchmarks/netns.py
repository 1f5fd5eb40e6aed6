"""Two network namespaces joined by a veth pair: a real TCP link between processes of one host,
for benchmarks that must not measure loopback (``pushpull.py --netns``). Needs root and ``ip``.

The servers' side (``srv``) holds ``10.213.0.1/24``, the client's side (``cli``) ``10.213.0.2/24``;
``rate`` (a ``tc`` rate such as ``10gbit``) shapes both directions with a token bucket, ``mtu``
sets both ends. Entering creates the pair; leaving kills whatever still runs inside either
namespace and deletes both (the veth goes with them), on errors too. Namespaces left by a run
that was killed with SIGKILL (their creator's pid is gone; its client gets SIGTERM then and
stops its servers) are removed the next time.

Example::

    with NamespacePair(rate="10gbit") as pair:
        subprocess.run([*pair.exec_in(pair.server_ns), "python", "server.py", pair.server_ip])
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

PREFIX = "hsbench"
SERVER_IP, CLIENT_IP, PREFIX_LEN = "10.213.0.1", "10.213.0.2", 24
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(srv|cli)$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$")
_RATE_SCALE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
#: tc's token bucket must hold at least one timer tick's worth of bytes at the rate.
_BURST_SECONDS = 0.004
_MIN_BURST = 1 << 20
_PR_SET_PDEATHSIG = 1


class NetnsUnavailable(RuntimeError):
    """The namespaces cannot be made here (not root, no ``ip``, or a command failed)."""


def rate_bits(rate: str) -> float:
    """Bits per second of a ``tc`` rate.

    >>> rate_bits("10gbit"), rate_bits("250mbps")
    (10000000000.0, 2000000000.0)
    """
    match = _RATE.match(rate.strip().lower())
    if match is None:
        raise ValueError(f"rate {rate!r}: expected a number and one of {', '.join(_RATE_SCALE)}"
                         " (tc's units), e.g. 10gbit")
    return float(match.group(1)) * _RATE_SCALE[match.group(2)]


def burst_bytes(rate: str) -> int:
    """The token bucket's size for ``rate``: 4 ms at the rate, at least 1 MiB.

    >>> burst_bytes("1gbit"), burst_bytes("40gbit")
    (1048576, 20000000)
    """
    return max(_MIN_BURST, int(rate_bits(rate) / 8 * _BURST_SECONDS))


def stale_namespaces(listing: str, alive: Callable[[int], bool]) -> list[str]:
    """Namespaces in ``ip netns list`` output made by a process that is gone.

    >>> stale_namespaces("hsbench-7-srv (id: 3)\\nhsbench-8-cli\\nother\\n", lambda pid: pid == 8)
    ['hsbench-7-srv']
    """
    stale = []
    for line in listing.splitlines():
        name = line.split(" ", 1)[0].strip()
        match = _NAME.match(name)
        if match and not alive(int(match.group(1))):
            stale.append(name)
    return stale


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it is collected here if it is our child)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class NamespacePair:
    """The two namespaces and their link; a context manager (see the module docstring)."""

    def __init__(self, rate: str | None = None, mtu: int | None = None,
                 tag: int | None = None) -> None:
        if rate is not None:
            rate_bits(rate)  # refuse a bad rate before anything is made
        if mtu is not None and not 68 <= mtu <= 65535:
            raise ValueError(f"mtu {mtu}: expected 68-65535")
        self.rate, self.mtu = rate, mtu
        tag = os.getpid() if tag is None else tag
        self.server_ns, self.client_ns = f"{PREFIX}-{tag}-srv", f"{PREFIX}-{tag}-cli"
        self.server_ip, self.client_ip = SERVER_IP, CLIENT_IP
        self._made: list[str] = []

    def setup_commands(self) -> list[list[str]]:
        """The ``ip``/``tc`` commands that make the pair (the namespaces come first)."""
        srv, cli, dev_s, dev_c = self.server_ns, self.client_ns, "veth-srv", "veth-cli"
        commands = [
            ["ip", "link", "add", dev_s, "netns", srv, "type", "veth", "peer", "name", dev_c,
             "netns", cli],
        ]
        for ns, dev, ip in ((srv, dev_s, self.server_ip), (cli, dev_c, self.client_ip)):
            commands.append(["ip", "-n", ns, "addr", "add", f"{ip}/{PREFIX_LEN}", "dev", dev])
            if self.mtu is not None:
                commands.append(["ip", "-n", ns, "link", "set", dev, "mtu", str(self.mtu)])
            commands += [["ip", "-n", ns, "link", "set", dev, "up"],
                         ["ip", "-n", ns, "link", "set", "lo", "up"]]
            if self.rate is not None:
                commands.append(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev,
                                 "root", "tbf", "rate", self.rate, "burst",
                                 str(burst_bytes(self.rate)), "latency", "50ms"])
        return commands

    @staticmethod
    def exec_in(ns: str) -> list[str]:
        """The prefix that runs a command inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns]

    def describe(self) -> dict[str, object]:
        return {"server_ns": self.server_ns, "client_ns": self.client_ns,
                "rate": self.rate, "mtu": self.mtu or 1500, "link": "veth"}

    def __enter__(self) -> NamespacePair:
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (this process is not)")
        if shutil.which("ip") is None or (self.rate and shutil.which("tc") is None):
            raise NetnsUnavailable("the 'ip' command (iproute2) is not installed"
                                   + (", or 'tc' for the rate" if self.rate else ""))
        listing = self._run(["ip", "netns", "list"], check=False)
        for name in stale_namespaces(listing, _alive):
            log.info("removing %s, left by a run that is gone", name)
            self._delete(name)
        try:
            for ns in (self.server_ns, self.client_ns):
                self._run(["ip", "netns", "add", ns])
                self._made.append(ns)
            for command in self.setup_commands():
                self._run(command)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill what runs inside the namespaces, then delete them (safe to call twice)."""
        while self._made:
            self._delete(self._made.pop())

    @classmethod
    def _delete(cls, ns: str) -> None:
        pids = [int(p) for p in cls._run(["ip", "netns", "pids", ns], check=False).split()]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5.0
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if _alive(p)]
                time.sleep(0.05)
            if not pids:
                break
        cls._run(["ip", "netns", "del", ns], check=False)

    @staticmethod
    def _run(command: list[str], check: bool = True) -> str:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        if check and done.returncode != 0:
            raise NetnsUnavailable(f"{' '.join(command)} failed ({done.returncode}): "
                                   f"{done.stderr.strip()}")
        return done.stdout



def _die_with_parent() -> None:
    """In a child about to exec: get SIGTERM when the parent dies, even by SIGKILL (Linux
    keeps this across ``ip netns exec``'s exec)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def run_in_namespaces(script: str, argv: list[str], rate: str | None, mtu: int | None,
                      json_path: str | None) -> int:
    """Run ``script argv --netns-inner SERVER_NS`` in the client's namespace of a fresh pair
    (the script starts its servers with :meth:`NamespacePair.exec_in` of ``SERVER_NS``) and
    return its exit code; SIGTERM and SIGINT reach it, and the pair goes on any exit. Where
    the pair cannot be made, say why, write ``{"skipped": why}`` to ``json_path``, return 0."""
    try:
        pair = NamespacePair(rate, mtu).__enter__()
    except NetnsUnavailable as err:
        print(f"--netns: skipped: {err}", flush=True)
        if json_path:
            with open(json_path, "w") as out:
                json.dump({"skipped": str(err)}, out)
                out.write("\n")
        return 0
    child: subprocess.Popen | None = None
    try:
        print(f"--netns: servers in {pair.server_ns} ({pair.server_ip}), client in "
              f"{pair.client_ns} ({pair.client_ip}); veth, mtu {mtu or 'default'}, rate "
              f"{rate or 'unshaped'}", flush=True)
        child = subprocess.Popen([*pair.exec_in(pair.client_ns), sys.executable, script, *argv,
                                  "--netns-inner", pair.server_ns], preexec_fn=_die_with_parent)
        forward = lambda sig, _frame: child.send_signal(sig)  # noqa: E731
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        pair.close()
