"""The local launcher: a whole job (scheduler, servers, workers) as processes on this host.

Each child's output is prefixed with its role and rank; a progress bar follows the workers'
reported progress; every child is shut down when the workers finish, on Ctrl-C, or on error.

Example::

    cluster = LocalCluster(servers=2, workers=4, policy="async",
                           command=["python", "examples/fashion_mnist.py", "--epochs", "1"])
    exit_code = cluster.run()

The children's plumbing (environment, prefixed output, progress bar, shutdown) is
``children.py``'s.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import zmq

from hogshard.children import Child, JobOutput, spawn, stop_children, worker_environment
from hogshard.proto.errors import ConfigError, HogshardError, RequestTimeoutError
from hogshard.proto.manifest import load_manifest, manifest_ranks, resolve_checkpoint
from hogshard.proto.policy import parse_policy
from hogshard.proto.roles import Role
from hogshard.proto.security import load_security
from hogshard.proto.transport import RpcChannel
from hogshard.scheduler.replication import check_replication
from hogshard.scheduler.resharding import check_slots
from hogshard.status import ClusterView

log = logging.getLogger(__name__)

#: Servers a replicated job replaces before it gives up (a crash loop is not hidden).
MAX_SERVER_RESTARTS = 8
#: With ``respawn``: workers and schedulers killed by a signal that are started again before
#: the launcher gives up (``respawn`` is for fault drills, where many are killed on purpose).
MAX_RESPAWNS = 200
#: Seconds the launcher waits, once its workers are done, for the scheduler to take its final
#: checkpoint and exit (with --checkpoint-dir).
FINAL_CHECKPOINT_S = 120.0
#: The same without a final checkpoint: the servers hear of the end at their next heartbeat.
END_S = 15.0
#: The exit status of a process of the job stopped by SIGTERM (it left the job).
STOPPED_EXIT = 143


@dataclass
class LocalCluster:
    """A job on this host. ``command`` is the worker command (argv list)."""

    servers: int
    workers: int
    policy: str
    command: Sequence[str]
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 5.0
    replication: int = 1
    progress: bool = True
    codec: str | None = None
    service_log_level: str = "WARNING"
    startup_timeout: float = 60.0
    checkpoint_every: float | None = None
    checkpoint_dir: str | None = None
    restore: str | None = None
    keys: str | None = None
    embedding_slots: int = 0
    #: Start again a worker (same rank) or the scheduler (same address) that a signal killed,
    #: and replace killed servers without the cap of MAX_SERVER_RESTARTS (fault drills).
    respawn: bool = False
    #: The scheduler's status page on 127.0.0.1:PORT (0: off).
    http_port: int = 0
    #: The scheduler's port on 127.0.0.1 (0: any free port).
    scheduler_port: int = 0
    out: IO[str] = field(default_factory=lambda: sys.stdout)
    _children: list[Child] = field(default_factory=list)
    _output: JobOutput = field(init=False)
    _scheduler_address: str = ""
    _workdir: Path | None = None
    _respawns: int = 0
    #: Worker ranks killed, to start again once the scheduler no longer counts them alive.
    _pending_workers: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.servers < 1 or self.workers < 1:
            raise ConfigError(
                f"need at least one server and one worker; got servers={self.servers} "
                f"workers={self.workers}"
            )
        if not self.command:
            raise ConfigError("no worker command given; expected: hogshard launch ... -- CMD ...")
        load_security(self.keys, Role.ADMIN)  # a bad keys folder is refused before anything starts
        parse_policy(self.policy)  # a bad spec is refused before anything starts
        check_replication(self.replication)
        check_slots(self.embedding_slots)
        self._output = JobOutput(self.out, self.progress)

    # ---- output -----------------------------------------------------------------------------

    def _emit(self, text: str) -> None:
        self._output.emit(text)

    def _spawn(self, role: str, rank: int, argv: Sequence[str], env: dict[str, str]) -> Child:
        child = spawn(self._output, role, rank, argv, env)
        self._children.append(child)
        return child

    # ---- lifecycle --------------------------------------------------------------------------

    def _hogshard(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "hogshard", "--log-level", self.service_log_level, *args]

    def _keys_args(self) -> list[str]:
        return ["--keys", str(Path(self.keys).resolve())] if self.keys else []

    def _checkpoint_args(self) -> list[str]:
        args = ["--restore", self.restore] if self.restore else []
        if self.checkpoint_dir:
            args += ["--checkpoint-dir", self.checkpoint_dir]
        if self.checkpoint_every:
            args += ["--checkpoint-every", str(self.checkpoint_every)]
        return args

    def _start_scheduler(self, workdir: Path, bind: str = "tcp://127.0.0.1:0") -> str:
        address_file = workdir / f"scheduler-{self._respawns}.address"
        child = self._spawn("scheduler", 0, self._hogshard(
            "scheduler", "--bind", bind, "--address-file", str(address_file),
            "--policy", self.policy, "--servers", str(self.servers),
            "--heartbeat-interval", str(self.heartbeat_interval),
            "--heartbeat-timeout", str(self.heartbeat_timeout),
            "--replication", str(self.replication),
            "--embedding-slots", str(self.embedding_slots), *self._checkpoint_args(),
            "--num-workers", str(self.workers), "--exit-when-done",
            *self._keys_args(),
            *(["--http-port", str(self.http_port), "--http-host", "127.0.0.1"]
              if self.http_port else []),
        ), dict(os.environ))
        deadline = time.monotonic() + self.startup_timeout
        while not address_file.exists():
            if child.process.poll() is not None:
                raise HogshardError(f"the scheduler exited with code {child.process.returncode}")
            if time.monotonic() > deadline:
                raise RequestTimeoutError("the scheduler did not start in time")
            time.sleep(0.05)
        return address_file.read_text().strip()

    def run(self) -> int:
        """Run the job to the end; the exit code is non-zero if any worker failed.
        SIGTERM and Ctrl-C stop every process of the job."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _interrupt)
        try:
            with tempfile.TemporaryDirectory(prefix="hogshard-") as workdir:
                self._workdir = Path(workdir)
                scheduler = self._start_scheduler(
                    Path(workdir), bind=f"tcp://127.0.0.1:{self.scheduler_port}")
                self._emit(f"[launch] scheduler at {scheduler}; {self.servers} servers, "
                           f"{self.workers} workers, policy {self.policy}")
                self._emit(f"[launch] CURVE on: keys from {self.keys}" if self.keys else
                           "[launch] no --keys: plain TCP on 127.0.0.1 (loopback only)")
                if self.http_port:
                    self._emit(f"[launch] status page at http://127.0.0.1:{self.http_port}/")
                self._scheduler_address = scheduler
                for rank in self._server_ranks():
                    self._start_server(scheduler, rank)
                for rank in range(self.workers):
                    self._start_worker(rank)
                return self._supervise(scheduler)
        except KeyboardInterrupt:
            self._emit("[launch] interrupted; stopping every process")
            return 130
        except JobFailed as failure:
            self._emit(f"[launch] ERROR: {failure.message}")
            return 1
        finally:
            self._stop_all()

    def _start_worker(self, rank: int) -> None:
        threads = max(1, (os.cpu_count() or 1) // self.workers)
        self._spawn("worker", rank, list(self.command),
                    worker_environment(self._scheduler_address, rank, self.workers, threads,
                                       codec=self.codec, keys=self.keys))

    def _workers(self) -> list[Child]:
        """The current worker of each rank (not those killed and started again)."""
        return [c for c in self._children if c.role == "worker" and not c.replaced]

    def _supervise(self, scheduler: str) -> int:
        context = zmq.Context()
        channel = RpcChannel(context, scheduler, sender="launcher",
                             security=load_security(self.keys, Role.ADMIN))
        view = ClusterView({})
        try:
            self._output.open_bar()
            while True:
                self._check_infrastructure()
                if self._pending_workers:
                    self._respawn_workers(view)
                elif not any(w.process.poll() is None for w in self._workers()):
                    break
                try:
                    view = ClusterView(channel.call("status", timeout=2.0).header)
                    self._output.update_bar(view)
                except HogshardError:
                    pass
                time.sleep(0.5)
            try:
                view = ClusterView(channel.call("status", timeout=2.0).header)
                channel.call("shutdown", timeout=2.0)  # the job ends (if not already)
            except HogshardError as err:
                if not self._scheduler_ended():  # one that ended the job was heard last above
                    self._emit(f"[launch] final status unavailable: {err.message}")
            # every worker done: the scheduler ends the job (final checkpoint, servers told)
            self._await_scheduler(FINAL_CHECKPOINT_S if self.checkpoint_dir else END_S)

        finally:
            self._output.close_bar()
            channel.close()
            context.term()
        for line in view.summary_lines():
            self._emit(f"[launch] {line}")
        failed = [w for w in self._workers() if w.process.returncode != 0]
        for w in failed:
            self._emit(f"[launch] {w.label} exited with code {w.process.returncode}")
        return 1 if failed else 0

    def _scheduler_ended(self) -> bool:
        return any(c.role == "scheduler" and c.process.poll() == 0 for c in self._children)

    def _await_scheduler(self, timeout: float) -> None:
        """Until the scheduler has ended the job and exited (at most ``timeout`` seconds)."""
        for child in self._children:
            if child.role == "scheduler":
                try:
                    child.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._emit("[launch] the scheduler did not end the job in "
                               f"{timeout:.0f} s; stopping it")

    def _check_infrastructure(self) -> None:
        """Stop the job if the scheduler or (unreplicated) a server failed (one that exits 0
        has seen the job end, docs/LIFECYCLE.md); with replication
        a server that exited is replaced (same rank): its backups took over, and the new one
        becomes their backup."""
        for child in list(self._children):
            if child.replaced or child.process.poll() is None:
                continue
            if self._respawned(child):
                continue
            if child.role == "worker":
                if child.process.returncode != 0:
                    why = "(--respawn starts again only one killed by a signal or SIGTERM)" \
                        if self.respawn else "and --respawn is off"
                    raise JobFailed(f"{child.label} exited with code "
                                    f"{describe_exit(child.process.returncode)} {why}; stopping "
                                    "the job (every other process is sent SIGTERM), exit "
                                    "status 1")
                continue  # it finished; the job ends once every worker has
            if child.process.returncode == 0:
                continue  # the job ended (every worker done, or `hogshard stop`)
            restarts = sum(1 for c in self._children if c.role == "server" and c.replaced)
            if child.role == "server" and self.replication > 1 \
                    and (restarts < MAX_SERVER_RESTARTS or self.respawn):
                child.replaced = True
                self._emit(f"[launch] {child.label} exited with code "
                           f"{child.process.returncode}; its backups take over, starting a "
                           "replacement")
                self._start_server(self._scheduler_address, child.rank, restore=False)
                continue
            raise JobFailed(f"{child.label} exited with code "
                            f"{describe_exit(child.process.returncode)}; stopping the job "
                            "(every other process is sent SIGTERM), exit status 1")

    def _server_ranks(self) -> list[int]:
        """0 .. --servers - 1, or with --restore the ranks whose files the checkpoint holds
        (a job whose servers were added and drained, e.g. ranks 1 and 2)."""
        if self.restore:
            try:
                ranks = manifest_ranks(load_manifest(resolve_checkpoint(Path(self.restore)),
                                                     verify_ranks=set()))
            except HogshardError:
                ranks = []  # the scheduler says what is wrong with it
            if len(ranks) == self.servers:
                return ranks
        return list(range(self.servers))

    def _respawned(self, child: Child) -> bool:
        """With ``respawn``: a worker or the scheduler that a signal killed (or SIGTERM stopped:
        exit status 143) is started again
        (a worker once the scheduler has declared its rank dead: a live rank is not handed out
        twice). Returns whether ``child`` was taken care of."""
        code = child.process.returncode
        if not self.respawn or child.role == "server" or (code >= 0 and code != STOPPED_EXIT) \
                or self._respawns >= MAX_RESPAWNS:
            return False
        child.replaced = True
        self._respawns += 1
        self._emit(f"[launch] {child.label} was killed (code {child.process.returncode}); "
                   "starting it again")
        if child.role == "scheduler":
            assert self._workdir is not None
            self._start_scheduler(self._workdir, bind=self._scheduler_address)
        else:
            self._pending_workers[child.rank] = time.monotonic() + 2 * self.heartbeat_timeout
        return True

    def _respawn_workers(self, view: ClusterView) -> None:
        """Start the killed workers whose rank the scheduler no longer counts alive (or that
        waited twice the heartbeat timeout: a scheduler restarted meanwhile never knew them)."""
        alive = {m.get("rank") for m in view.status.get("members", ())
                 if m.get("role") == "worker" and m.get("state") == "alive"}
        now = time.monotonic()
        for rank, deadline in list(self._pending_workers.items()):
            if rank not in alive or now > deadline:
                del self._pending_workers[rank]
                self._start_worker(rank)

    def _start_server(self, scheduler: str, rank: int, restore: bool = True) -> None:
        self._spawn("server", rank, self._hogshard(
            "server", "--scheduler", scheduler, "--rank", str(rank), *self._keys_args(),
            *(["--restore", self.restore] if self.restore and restore else [])), dict(os.environ))

    def _stop_all(self, grace: float = 5.0) -> None:
        stop_children(self._children, grace)


class JobFailed(HogshardError):
    """A process of the job failed and the launcher ends the job (exit status 1)."""


def describe_exit(code: int) -> str:
    """A child's exit code as an operator reads it.

    >>> describe_exit(-9), describe_exit(143), describe_exit(1)
    ('-9 (killed by SIGKILL)', '143 (stopped by SIGTERM)', '1')
    """
    if code < 0:
        try:
            return f"{code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"{code} (killed by signal {-code})"
    if code == STOPPED_EXIT:
        return f"{STOPPED_EXIT} (stopped by SIGTERM)"
    return str(code)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
