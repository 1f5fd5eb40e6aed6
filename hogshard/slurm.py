"""Bring a job up under SLURM: ``srun hogshard slurm --servers 2 -- python train.py``.

Every task of the step runs this command; it reads SLURM's environment and becomes one role of
the job through the same CLI code paths as a hand-started cluster:

* task 0 runs the scheduler (on the first node of the step, ``SLURM_STEP_NODELIST``, port
  ``--port``) and server 0, and ends the job once every worker has finished;
* tasks 1 .. servers-1 run one server each (data port ``--port + 1 + SLURM_LOCALID``);
* the other tasks run ``hogshard worker`` with rank ``SLURM_PROCID - servers``.

With ``--replication 2`` a server process that dies (a crash, ``kill -9``) is started again by
its task under the same rank: its backups serve its chunks meanwhile and the new process becomes
their backup (as ``hogshard launch`` does). A server that exits 0 (the scheduler ended the job,
or SIGTERM) is not.

The processes inherit the environment: set ``HOGSHARD_KEYS`` (a folder from ``hogshard keys
generate``, on a shared file system) to encrypt the job's links, or ``HOGSHARD_INSECURE=1`` to
allow plain TCP, which servers and the scheduler otherwise refuse on a non-loopback address.

Example::

    >>> expand_nodelist("node[01-03,05],gpu7")
    ['node01', 'node02', 'node03', 'node05', 'gpu7']
    >>> plan = plan_task(SlurmTask(procid=3, ntasks=4, nodes=["n1", "n2"], localid=1,
    ...                            nodename="n2"), servers=2, port=7000)
    >>> plan.role, plan.worker_rank, plan.num_workers, plan.scheduler
    ('worker', 1, 2, 'tcp://n1:7000')
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import click

from hogshard.cli_options import check_codec, check_policy
from hogshard.proto.config import DEFAULT_HEARTBEAT_TIMEOUT, env_name
from hogshard.proto.errors import ConfigError, HogshardError

log = logging.getLogger(__name__)

#: Restarts of one task's server process (--replication 2) before the task gives up.
MAX_SERVER_RESTARTS = 8

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split at commas that are not inside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0:
            raise ConfigError(f"SLURM_NODELIST={text!r}: unbalanced ']'")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ConfigError(f"SLURM_NODELIST={text!r}: unbalanced '['")
    return [*parts, current]


def expand_nodelist(text: str) -> list[str]:
    """Expand SLURM's compressed host list (``node[01-03,05]``, ``a,b``, ``r[1-2]n[1-2]``)."""
    hosts: list[str] = []
    for part in _split_top(text.strip()):
        if not part:
            continue
        match = re.search(r"\[([^\]]*)\]", part)
        if match is None:
            hosts.append(part)
            continue
        prefix, rest = part[:match.start()], part[match.end():]
        for item in match.group(1).split(","):
            found = _RANGE.match(item.strip())
            if found is None:
                raise ConfigError(f"SLURM_NODELIST={text!r}: bad range {item!r}; expected "
                                  "N or N-M inside brackets")
            low, high = found.group(1), found.group(2) or found.group(1)
            if int(high) < int(low):
                raise ConfigError(f"SLURM_NODELIST={text!r}: range {item!r} runs backwards")
            for number in range(int(low), int(high) + 1):
                hosts.extend(expand_nodelist(f"{prefix}{number:0{len(low)}d}{rest}"))
    return hosts


@dataclass(frozen=True)
class SlurmTask:
    """This task's place in the step, from SLURM's environment."""

    procid: int
    ntasks: int
    nodes: list[str]
    localid: int
    nodename: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SlurmTask:
        environ = os.environ if environ is None else environ

        def number(name: str, default: int | None = None) -> int:
            raw = environ.get(name)
            if raw is None or raw.strip() == "":
                if default is None:
                    raise ConfigError(f"{name} is not set; expected to run under srun "
                                      "(or set SLURM_PROCID, SLURM_NTASKS, SLURM_NODELIST)")
                return default
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r}: expected an integer") from None

        procid, ntasks = number("SLURM_PROCID"), number("SLURM_NTASKS")
        # The step's nodes: srun may run on a subset of the job's allocation (-w, -x, -N),
        # and task 0 runs on the step's first node, not necessarily the job's.
        nodes = expand_nodelist(environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_NODELIST")
                                or environ.get("SLURM_JOB_NODELIST") or "")
        if not nodes:
            raise ConfigError("SLURM_NODELIST is not set; expected e.g. node[01-04]")
        if not 0 <= procid < ntasks:
            raise ConfigError(f"SLURM_PROCID={procid}: expected 0 <= procid < SLURM_NTASKS="
                              f"{ntasks}")
        nodeid = number("SLURM_NODEID", 0)
        nodename = environ.get("SLURMD_NODENAME") or nodes[min(nodeid, len(nodes) - 1)]
        return cls(procid, ntasks, nodes, number("SLURM_LOCALID", 0), nodename)


@dataclass(frozen=True)
class TaskPlan:
    role: str  # "scheduler+server", "server" or "worker"
    scheduler: str
    server_rank: int | None = None
    server_port: int | None = None
    advertise: str | None = None
    worker_rank: int | None = None
    num_workers: int = 0
    servers: int = 1


def plan_task(task: SlurmTask, servers: int, port: int) -> TaskPlan:
    """What this task runs (pure: tested without processes)."""
    if servers < 1 or task.ntasks <= servers:
        raise ConfigError(f"SLURM_NTASKS={task.ntasks} with --servers {servers}: expected more "
                          "tasks than servers (the rest are workers)")
    scheduler = f"tcp://{task.nodes[0]}:{port}"
    workers = task.ntasks - servers
    if task.procid < servers:
        server_port = port + 1 + task.localid
        return TaskPlan("scheduler+server" if task.procid == 0 else "server", scheduler,
                        server_rank=task.procid, server_port=server_port,
                        advertise=f"tcp://{task.nodename}:{server_port}", num_workers=workers,
                        servers=servers)
    return TaskPlan("worker", scheduler, worker_rank=task.procid - servers, num_workers=workers,
                    servers=servers)


def _hogshard(*args: str) -> list[str]:
    return [sys.executable, "-m", "hogshard", *args]


def exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _stop(processes: Sequence[subprocess.Popen], grace: float = 5.0) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


#: A server's exit status once SIGTERM stopped it (it left the job: a requested stop).
STOPPED = 143


class ServerKeeper:
    """This task's server process. With replication, one that exits non-zero (a crash, a
    SIGKILL) before the job ends is started again under its rank, up to ``max_restarts``
    times; one that exits 0 (the scheduler ended the job) or 143 (stopped by SIGTERM: it left
    the job) is done."""

    def __init__(self, argv: Sequence[str], rank: int, replication: int,
                 max_restarts: int = MAX_SERVER_RESTARTS) -> None:
        self.argv, self.rank, self.replication = list(argv), rank, replication
        self.max_restarts = max_restarts
        self.restarts = 0
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        process = subprocess.Popen(self.argv)
        log.info("server %d: pid %d", self.rank, process.pid)
        return process

    def poll(self) -> int | None:
        """None while a server process runs (restarting a dead one if allowed), else the
        exit code the task should end with."""
        code = self.process.poll()
        if code is None:
            return None
        if code not in (0, STOPPED) and self.replication > 1 \
                and self.restarts < self.max_restarts:
            self.restarts += 1
            log.warning("server %d exited with code %d; its backups take over, starting a "
                        "replacement (restart %d of at most %d)", self.rank, exit_code(code),
                        self.restarts, self.max_restarts)
            self.process = self._start()
            return None
        return exit_code(code)

    def wait(self) -> int:
        """Block until the server is done for good; its exit code."""
        while True:
            self.process.wait()
            code = self.poll()
            if code is not None:
                return code

    def stop(self) -> None:
        _stop([self.process])


def _end_when_workers_done(scheduler: str, workers: int, join_timeout: float,
                           scheduler_process: subprocess.Popen, server: ServerKeeper) -> int:
    """Poll the scheduler until every worker has registered and none is alive, then end the
    job (``shutdown``). Returns 0 if every worker left cleanly."""
    import zmq

    from hogshard.proto.roles import Role
    from hogshard.proto.security import load_security
    from hogshard.proto.transport import RpcChannel

    context = zmq.Context()
    # The same keys as the processes it started (HOGSHARD_KEYS), or plain TCP.
    security = load_security(os.environ.get(env_name("keys")) or None, Role.ADMIN)
    channel = RpcChannel(context, scheduler, sender="slurm", security=security)
    started = time.monotonic()
    try:
        while True:
            if scheduler_process.poll() is not None:
                log.error("the scheduler exited with code %d; ending the job",
                          exit_code(scheduler_process.returncode))
                return 1
            if server.poll() is not None:
                log.error("server %d of task 0 exited for good; ending the job", server.rank)
                return 1
            try:
                members = channel.call("status", timeout=5.0).header["members"]
            except HogshardError as err:
                log.warning("scheduler status: %s", err.message)
                members = None
            if members is not None:
                seen = [m for m in members if m["role"] == "worker"]
                if len(seen) >= workers and not any(m["state"] == "alive" for m in seen):
                    dead = [m["node_id"] for m in seen if m["state"] == "dead"]
                    channel.call("shutdown", timeout=5.0)
                    if dead:
                        log.error("workers died: %s", dead)
                    return 1 if dead else 0
                if len(seen) < workers and time.monotonic() - started > join_timeout:
                    log.error("%d of %d workers joined in %.0f s; ending the job", len(seen),
                              workers, join_timeout)
                    channel.call("shutdown", timeout=5.0)
                    return 1
            time.sleep(0.5)
    finally:
        channel.close()
        context.term()


def run_task(plan: TaskPlan, command: Sequence[str], policy: str, heartbeat_timeout: float,
             join_timeout: float, codec: str | None = None, replication: int = 1) -> int:
    """Run this task's role to the end; its exit code."""
    if plan.role == "worker":
        argv = _hogshard("worker", "--scheduler", plan.scheduler, "--rank", str(plan.worker_rank),
                         "--num-workers", str(plan.num_workers),
                         *(["--codec", codec] if codec else []), "--", *command)
        os.execv(argv[0], argv)
    port = plan.scheduler.rsplit(":", 1)[1]
    assert plan.server_rank is not None
    server_argv = _hogshard("server", "--scheduler", plan.scheduler, "--rank",
                            str(plan.server_rank), "--bind", f"tcp://0.0.0.0:{plan.server_port}",
                            "--advertise", str(plan.advertise))
    scheduler: subprocess.Popen | None = None
    server: ServerKeeper | None = None
    try:
        if plan.role == "server":
            server = ServerKeeper(server_argv, plan.server_rank, replication)
            return server.wait()
        scheduler = subprocess.Popen(_hogshard(
            "scheduler", "--bind", f"tcp://0.0.0.0:{port}", "--policy", policy,
            "--servers", str(plan.servers), "--heartbeat-timeout", str(heartbeat_timeout),
            "--replication", str(replication)))
        server = ServerKeeper(server_argv, plan.server_rank, replication)
        code = _end_when_workers_done(plan.scheduler, plan.num_workers, join_timeout, scheduler,
                                      server)
        try:
            server.process.wait(timeout=max(10.0, 4 * heartbeat_timeout))
        except subprocess.TimeoutExpired:
            pass
        return code
    finally:
        if server is not None:
            server.stop()
        if scheduler is not None:
            _stop([scheduler])


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--servers", default=1, type=click.IntRange(min=1), envvar=env_name("servers"),
              show_default=True, show_envvar=True, help="tasks that run a server")
@click.option("--port", default=7000, type=click.IntRange(1, 65000), show_default=True,
              envvar=env_name("port"), show_envvar=True,
              help="scheduler port on the first node; servers use PORT+1+SLURM_LOCALID")
@click.option("--policy", default="async", envvar=env_name("policy"), show_default=True,
              show_envvar=True, callback=check_policy, help="consistency policy")
@click.option("--heartbeat-timeout", default=DEFAULT_HEARTBEAT_TIMEOUT, show_default=True,
              type=click.FloatRange(min=0.05), envvar=env_name("heartbeat-timeout"),
              show_envvar=True, help="seconds of silence after which a member is declared dead")
@click.option("--join-timeout", default=300.0, show_default=True, type=click.FloatRange(min=1),
              envvar=env_name("join-timeout"), show_envvar=True,
              help="seconds for every worker to register")
@click.option("--codec", default=None, envvar=env_name("codec"), show_envvar=True,
              callback=check_codec, help="gradient compression, as for `hogshard worker --codec`")
@click.option("--replication", default=1, type=click.IntRange(min=1, max=2), show_default=True,
              envvar=env_name("replication"), show_envvar=True,
              help="copies of each dense chunk: 2 keeps a backup on another server, and a "
              "server task starts its server again when that process dies")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def slurm(servers: int, port: int, policy: str, heartbeat_timeout: float, join_timeout: float,
          codec: str | None, replication: int, command: tuple[str, ...]) -> None:
    """Run this SLURM task's part of a job: ``srun hogshard slurm --servers 2 -- CMD``.

    Task 0 runs the scheduler and server 0, tasks 1..SERVERS-1 a server each, the others
    COMMAND as workers. CURVE keys come from HOGSHARD_KEYS (plain TCP needs
    HOGSHARD_INSECURE=1). Task 0 exits 0 once every worker has finished, 1 if a worker died
    or not every worker registered within --join-timeout; it then ends the job (every server
    exits 0). With --replication 2 a server process that dies is started again by its task."""
    from hogshard.proto.policy import parse_policy
    from hogshard.proto.roles import Role
    from hogshard.proto.security import load_security
    from hogshard.scheduler.replication import check_replication

    try:
        task = SlurmTask.from_env()
        plan = plan_task(task, servers, port)
        parse_policy(policy)
        check_replication(replication)
        load_security(os.environ.get(env_name("keys")) or None, Role.ADMIN)  # a bad folder fails here
    except HogshardError as err:
        raise click.ClickException(err.message) from None
    log.info("task %d/%d on %s: %s (scheduler %s)", task.procid, task.ntasks, task.nodename,
             plan.role, plan.scheduler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(run_task(plan, list(command), policy, heartbeat_timeout, join_timeout, codec,
                      replication))
