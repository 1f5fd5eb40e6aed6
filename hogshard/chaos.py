"""Fault storms against a job of ``hogshard launch --respawn``: a seeded plan of faults, the
job's processes found from the launcher's process tree, and each fault's recovery timed.

A fault is ``kill`` (SIGKILL) or ``stop`` (SIGSTOP, then SIGCONT after a hold drawn from the
plan) of the scheduler, a server or a worker, by rank, or (``CUT_WEIGHTS``) ``cut``: a server
partitioned from the scheduler or from the other server for a hold, then healed
(``hogshard/chaos_partition.py``). Another :class:`Injector` makes the same plan's faults
elsewhere (``benchmarks/chaos_compose.py``: containers). The launcher starts a killed process
again (same rank, the scheduler on the same address) and replaces a server that was fenced
while frozen. A fault has recovered when, after it ended (the kill, or the SIGCONT), the
scheduler answers, every expected server and worker is alive, every chunk of the table has a
primary and a backup, the fault's own member is back (a server at a new address after a
kill; a worker whose own step moved on) and the workers' steps moved on; a fault of a worker or the scheduler must
declare no server gone (its ``collateral``). The next fault waits
for that, so one server is down at a time: the failure model of ``--replication 2``.

Example::

    storm = Storm(seed=1, launcher_pid=proc.pid, status=status_fn, steps=steps_fn, servers=2,
                  workers=2, table="model")
    while time.monotonic() < end:
        storm.step(interval=5.0)
    storm.finish()
    print(storm.table())
"""

from __future__ import annotations

import logging
import os
import random
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hogshard.chaos_partition import Partitions

log = logging.getLogger(__name__)

ROLES = ("scheduler", "server", "worker")
KINDS = ("kill", "stop", "cut")
#: How a plan weighs (kind, role): servers are where the data is, so they are hit most.
WEIGHTS = {("kill", "server"): 3, ("stop", "server"): 3, ("kill", "worker"): 2,
           ("stop", "worker"): 2, ("kill", "scheduler"): 1, ("stop", "scheduler"): 1}
#: Partitions (``cut``, healed after a hold): a server from the scheduler (it still reaches
#: the workers and the other server), and a server from the other server, its backup.
CUT_WEIGHTS = {("cut", "server|scheduler"): 2, ("cut", "server|server"): 2}


class Injector(Protocol):
    """What makes a fault happen: ``inject`` returns once the fault has ended (a kill done, a
    frozen process thawed, a cut healed), False when there was nothing to hit."""

    #: Whether a server killed comes back at a new address (then its recovery waits for it).
    kill_moves_server: bool

    def inject(self, kind: str, role: str, rank: int, hold: float) -> bool: ...


@dataclass(frozen=True)
class JobProcess:
    """One process of the job: its pid, start time (to tell a reused pid) and role/rank."""

    pid: int
    started: str
    role: str
    rank: int


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _start_time(pid: int) -> str | None:
    stat = _read(Path(f"/proc/{pid}/stat")).decode(errors="replace")
    return stat[stat.rindex(")") + 2:].split()[19] if ")" in stat else None


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        stat = _read(entry / "stat").decode(errors="replace")
        if ")" in stat:
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(root: int) -> list[int]:
    """Every live descendant of ``root`` (from /proc)."""
    tree, found, frontier = _children(), [], [root]
    while frontier:
        for pid in tree.get(frontier.pop(), []):
            found.append(pid)
            frontier.append(pid)
    return found


def classify(pid: int) -> JobProcess | None:
    """The role and rank of a process the launcher started, or None (not one of the job's,
    a zombie, or gone)."""
    argv = _read(Path(f"/proc/{pid}/cmdline")).decode(errors="replace").split("\0")
    started = _start_time(pid)
    state = _read(Path(f"/proc/{pid}/stat")).decode(errors="replace")
    if started is None or ") Z " in state:
        return None
    if "hogshard" in argv and "scheduler" in argv:
        return JobProcess(pid, started, "scheduler", 0)
    if "hogshard" in argv and "server" in argv and "--rank" in argv:
        return JobProcess(pid, started, "server", int(argv[argv.index("--rank") + 1]))
    env = _read(Path(f"/proc/{pid}/environ")).split(b"\0")
    ranks = [e.split(b"=", 1)[1] for e in env if e.startswith(b"HOGSHARD_RANK=")]
    if ranks and "hogshard" not in argv:
        return JobProcess(pid, started, "worker", int(ranks[0]))
    return None


def job_processes(launcher_pid: int) -> list[JobProcess]:
    """The scheduler, servers and workers under a launcher."""
    return [p for p in map(classify, descendants(launcher_pid)) if p is not None]


def signal_if_same(proc: JobProcess, sig: int) -> bool:
    """Send ``sig`` to ``proc`` if that pid is still the same process; whether it was."""
    if _start_time(proc.pid) != proc.started:
        return False
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        return False
    return True


class ProcessInjector:
    """Faults of the processes under a launcher: ``kill`` (SIGKILL), ``stop`` (SIGSTOP, SIGCONT
    after the hold) and, given ``partitions``, ``cut`` (a server cut from the scheduler, role
    ``server|scheduler``, or from the other server, ``server|server``, healed after the
    hold)."""

    kill_moves_server = True

    def __init__(self, launcher_pid: int, partitions: Partitions | None = None) -> None:
        self.launcher_pid, self.partitions = launcher_pid, partitions

    def victim(self, role: str, rank: int) -> JobProcess | None:
        found = [p for p in job_processes(self.launcher_pid) if p.role == role and p.rank == rank]
        return max(found, key=lambda p: p.started) if found else None

    def inject(self, kind: str, role: str, rank: int, hold: float) -> bool:
        if kind == "cut":
            return self._cut(role, rank, hold)
        victim = self.victim(role, rank)
        if victim is None:
            return False
        log.info("%s %s %d (pid %d)", kind, role, rank, victim.pid)
        if kind == "kill":
            signal_if_same(victim, signal.SIGKILL)
        else:
            signal_if_same(victim, signal.SIGSTOP)
            time.sleep(hold)  # the fault's length, drawn from the plan
            signal_if_same(victim, signal.SIGCONT)
        return True

    def _cut(self, pair: str, rank: int, hold: float) -> bool:
        assert self.partitions is not None, "cut faults need partitions"
        other = self.victim("scheduler", 0) if pair == "server|scheduler" \
            else self.victim("server", 1 - rank)
        server = self.victim("server", rank)
        if server is None or other is None:
            return False
        cut = self.partitions.cut(server.pid, other.pid)
        try:
            time.sleep(hold)  # the partition's length, drawn from the plan
        finally:
            self.partitions.heal(cut)
        return True


@dataclass
class Fault:
    """One injected fault and what became of it (times in seconds since the storm began)."""

    kind: str
    role: str
    rank: int
    at: float
    hold: float = 0.0  # a stop's time frozen
    ended: float | None = None  # the kill, or the SIGCONT
    recovered: float | None = None
    #: Servers declared gone over a fault that was not a server's (map events): damage the
    #: fault should not have done.
    collateral: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.kind} {self.role}"

    @property
    def recover_s(self) -> float | None:
        return None if self.recovered is None or self.ended is None \
            else self.recovered - self.ended


@dataclass
class Storm:
    """A seeded storm against one launcher. ``status``: the scheduler's status (None when it
    does not answer); ``steps``: the steps each worker rank has finished."""

    seed: int
    launcher_pid: int
    status: Callable[[], dict[str, Any] | None]
    steps: Callable[[], dict[int, int]]
    servers: int
    workers: int
    table: str
    heartbeat_timeout: float = 3.0
    recover_timeout: float = 90.0
    poll: float = 0.2
    #: The plan's faults and their weights (``WEIGHTS``, with ``CUT_WEIGHTS`` for partitions).
    weights: dict[tuple[str, str], int] = field(default_factory=lambda: dict(WEIGHTS))
    #: What injects the faults (default: a :class:`ProcessInjector` of ``launcher_pid``).
    injector: Injector | None = None
    faults: list[Fault] = field(default_factory=list)
    _rng: random.Random = field(init=False)
    _start: float = field(init=False, default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        if self.injector is None:
            self.injector = ProcessInjector(self.launcher_pid)

    def now(self) -> float:
        return time.monotonic() - self._start

    def healthy(self, view: dict[str, Any] | None) -> bool:
        """Every expected member alive, every chunk of the table with a primary and a backup."""
        return self.unhealthy(view) is None

    def unhealthy(self, view: dict[str, Any] | None) -> str | None:
        """What keeps the job from being healthy (None when it is)."""
        if not view:
            return "the scheduler does not answer"
        alive = {(m["role"], m["rank"]) for m in view.get("members", ())
                 if m.get("state") == "alive"}
        missing = [f"{role}-{r}" for role, n in (("server", self.servers),
                                                 ("worker", self.workers))
                   for r in range(n) if (role, r) not in alive]
        if missing:
            return f"not alive: {missing}"
        table = view.get("tables", {}).get(self.table)
        if not table or not table.get("ready"):
            return f"table {self.table} not ready"
        bad = [c for c in table["chunks"]
               if not (len(c) == 5 and c[3] >= 0 and c[4] >= 0 and c[3] != c[4])]
        return f"chunks without a primary and a backup: {bad}" if bad else None

    def _incarnation(self, view: dict[str, Any] | None, rank: int) -> Any:
        """What tells a live server process from the one before it under ``rank``: its
        address (a new process binds a new port)."""
        for m in (view or {}).get("members", ()):
            if m["role"] == "server" and m["rank"] == rank and m.get("state") == "alive":
                return m.get("address")
        return None

    def _await(self, done: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if done():
                return True
            time.sleep(self.poll)
        return done()

    def wait_healthy(self) -> bool:
        """Until the job is healthy (at most ``recover_timeout`` seconds); whether it is."""
        return self._await(lambda: self.healthy(self.status()), self.recover_timeout)

    def draw(self) -> tuple[str, str, int, float]:
        """The plan's next fault: kind, role, rank and (a stop's) hold in seconds, from 0.3 to
        2 heartbeat timeouts (past one, the frozen member is declared dead)."""
        kind, role = self._rng.choices(list(self.weights),
                                       weights=list(self.weights.values()))[0]
        rank = 0 if role == "scheduler" else self._rng.randrange(
            self.workers if role == "worker" else self.servers)
        hold = round(self._rng.uniform(0.3, 2.0) * self.heartbeat_timeout, 2) \
            if kind != "kill" else 0.0
        return kind, role, rank, hold

    def step(self, interval: float) -> Fault | None:
        """Wait for the job to be healthy, then ``interval`` seconds (the first fault too),
        then inject the plan's next fault and wait for its recovery. Returns the fault, or None
        if the job was not healthy in time (the storm should end: a fault not recovered is
        counted as such)."""
        if not self.wait_healthy():
            return None
        time.sleep(interval)  # the storm's schedule, not a wait for an event
        kind, role, rank, hold = self.draw()
        injector = self.injector
        assert injector is not None
        fault = Fault(kind, role, rank, at=self.now(), hold=hold)
        before_view = self.status()
        before_events = _map_events(before_view)
        incarnation = self._incarnation(before_view, rank)
        log.info("%.1f s: %s %s %d%s", fault.at, kind, role, rank,
                 f" for {hold:.1f} s" if hold else "")
        if not injector.inject(kind, role, rank, hold):
            log.warning("no %s %d to %s; skipped", role, rank, kind)
            return None
        self.faults.append(fault)
        fault.ended = self.now()
        steps_at_end = self.steps()

        def recovered() -> bool:
            view = self.status()
            if not self.healthy(view):
                return False
            if kind == "kill" and role == "server" and injector.kill_moves_server and \
                    self._incarnation(view, rank) in (None, incarnation):
                return False
            steps = self.steps()
            if role == "worker" and steps.get(rank, 0) <= steps_at_end.get(rank, 0):
                return False
            return sum(steps.values()) > sum(steps_at_end.values())

        if self._await(recovered, self.recover_timeout):
            fault.recovered = self.now()
            if not role.startswith("server"):
                fault.collateral = sorted(e for e in _map_events(self.status()) - before_events
                                          if " gone" in e)
            log.info("%s %s %d recovered in %.1f s", kind, role, rank, fault.recover_s or 0.0)
        else:
            log.warning("%s %s %d: not recovered in %.0f s (%s; steps %s, %s at the end "
                        "of the fault)", kind, role, rank, self.recover_timeout,
                        self.unhealthy(self.status()), self.steps(), steps_at_end)
        return fault

    def summary(self) -> list[dict[str, Any]]:
        """Per fault kind: injected, recovered, median and max seconds to recover."""
        rows = []
        for kind, role in self.weights:
            mine = [f for f in self.faults if f.kind == kind and f.role == role]
            times = [f.recover_s for f in mine if f.recover_s is not None]
            rows.append({"fault": f"{kind} {role}", "injected": len(mine),
                         "recovered": len(times),
                         "median_s": round(statistics.median(times), 2) if times else None,
                         "max_s": round(max(times), 2) if times else None})
        times = [f.recover_s for f in self.faults if f.recover_s is not None]
        rows.append({"fault": "all", "injected": len(self.faults), "recovered": len(times),
                     "median_s": round(statistics.median(times), 2) if times else None,
                     "max_s": round(max(times), 2) if times else None})
        return rows

    def record(self) -> list[dict[str, Any]]:
        return [asdict(f) for f in self.faults]


def _map_events(view: dict[str, Any] | None) -> set[str]:
    """The shard map's recent changes (``status`` ``map_history``), as text."""
    return {f"epoch {e.get('epoch')}: {e.get('event')}"
            for e in (view or {}).get("map_history", ())}


def format_table(rows: list[dict[str, Any]]) -> str:
    """The summary rows as a fixed-width table."""
    lines = [f"{'fault':<22} {'injected':>8} {'recovered':>9} {'median s':>9} {'max s':>7}"]
    for r in rows:
        median = "-" if r["median_s"] is None else f"{r['median_s']:.1f}"
        most = "-" if r["max_s"] is None else f"{r['max_s']:.1f}"
        lines.append(f"{r['fault']:<22} {r['injected']:>8} {r['recovered']:>9} {median:>9} "
                     f"{most:>7}")
    return "\n".join(lines)
