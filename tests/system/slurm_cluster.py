"""A single-node SLURM cluster of real daemons, for the system tests.

:class:`SlurmCluster` writes a ``slurm.conf`` into a folder of its own and starts ``munged``
(its own key and socket), ``slurmctld`` and ``slurmd`` there, on free ports, so it touches
neither the host's ``/etc/slurm`` nor another cluster on the same host. The node is this host
under its own name (which must resolve), declared with more CPUs than it may have
(``SlurmdParameters=config_overrides``); no cgroup plugin (``proctrack/linuxproc``,
``task/none``), which also runs in containers. Jobs are submitted with ``sbatch`` and followed
with ``scontrol``; at the end every job is cancelled, every daemon stopped and every process
left with this cluster's ``SLURM_CONF`` in its environment killed, even on failure.

Example::

    with SlurmCluster(log_dir) as cluster:
        job = cluster.sbatch("docker/slurm/train.sbatch", options=["--ntasks=4"], env={})
        state, code = job.wait(timeout=600)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from tests.conftest import wait_until

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue",
            "scancel", "sinfo")
SETUP = REPO / "scripts" / "slurm-setup.sh"
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
POLL_S = 0.5
STOP_GRACE_S = 10.0
T = TypeVar("T")


def missing_commands() -> list[str]:
    return [c for c in COMMANDS if shutil.which(c) is None]


def slurm_ready() -> str | None:
    """None when this host can run the cluster (installing SLURM and munge through
    scripts/slurm-setup.sh where they are absent and this is root with apt-get), else why
    not."""
    if os.geteuid() != 0:
        return "a SLURM cluster needs root (slurmd runs jobs as their user)"
    if missing_commands():
        if shutil.which("apt-get") is None:
            return f"{', '.join(missing_commands())} missing and no apt-get to install them"
        done = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True,
                              timeout=900)
        if done.returncode != 0:
            return f"scripts/slurm-setup.sh failed: {done.stderr.strip()[-500:]}"
        if missing_commands():
            return f"still missing after scripts/slurm-setup.sh: {missing_commands()}"
    return None


def free_port(count: int = 1) -> int:
    """A port P with P .. P+count-1 free on every interface."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("", 0))
            port = first.getsockname()[1]
            if port + count > 65000:
                continue
            others = [socket.socket() for _ in range(count - 1)]
            try:
                for offset, sock in enumerate(others, start=1):
                    sock.bind(("", port + offset))
                return port
            except OSError:
                continue
            finally:
                for sock in others:
                    sock.close()
    raise AssertionError(f"no {count} consecutive free ports")


def node_name() -> str:
    """This host's name if it resolves (the nodes' names are the addresses jobs connect to),
    else ``localhost``."""
    name = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(name)
        return name
    except OSError:
        return "localhost"


class BatchJob:
    """One ``sbatch`` job: its id, its output file, its state."""

    def __init__(self, cluster: SlurmCluster, job_id: str, output: Path) -> None:
        self.cluster, self.id, self.output_path = cluster, job_id, output

    def output(self) -> str:
        try:
            return self.output_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def state(self) -> tuple[str, int | None]:
        """(JobState, the batch script's exit status once it ended, else None)."""
        text = self.cluster.run("scontrol", "-o", "show", "job", self.id).stdout
        state = re.search(r"\bJobState=(\S+)", text)
        code = re.search(r"\bExitCode=(\d+):(\d+)", text)
        assert state is not None, f"scontrol show job {self.id}: {text!r}"
        name = state.group(1)
        if name not in ENDED:
            return name, None
        return name, int(code.group(1)) if code else None

    def wait(self, timeout: float) -> tuple[str, int | None]:
        """Until the job has ended; (JobState, exit status)."""
        def ended() -> tuple[str, int | None] | None:
            state = self.state()
            return state if state[0] in ENDED else None

        found = wait_until(ended, timeout, f"job {self.id} to end", interval=POLL_S,
                           on_timeout=lambda: self.output()[-4000:])
        assert found is not None
        return found


class SlurmCluster:
    """munged, slurmctld and slurmd for one node, in a folder of their own."""

    def __init__(self, log_dir: Path, cpus: int = 8) -> None:
        self.log_dir, self.cpus = log_dir, cpus
        self.root = Path(tempfile.mkdtemp(prefix="hogshard-slurm-"))
        self.root.chmod(0o755)  # munged wants its socket's folder reachable by everyone
        self.conf = self.root / "slurm.conf"
        self.node = node_name()
        self.daemons: dict[str, subprocess.Popen] = {}
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        self.env["SLURM_CONF"] = str(self.conf)

    # ---- plumbing ---------------------------------------------------------------------------

    def run(self, *argv: str, timeout: float = 60.0, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({done.returncode}): "
                                 f"{done.stdout[-1000:]}{done.stderr[-2000:]}")
        return done

    def _daemon(self, name: str, argv: Sequence[str]) -> None:
        with open(self.root / f"{name}.out", "w") as log:  # the child keeps its own copy
            self.daemons[name] = subprocess.Popen(
                list(argv), env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)

    def tail_logs(self, lines: int = 30) -> str:
        parts = []
        for path in sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def _wait(self, condition: Callable[[], T], timeout: float, what: str) -> T:
        def checked() -> T:
            for name, process in self.daemons.items():
                if process.poll() is not None:
                    raise AssertionError(f"{name} exited with code {process.returncode}\n"
                                         f"{self.tail_logs()}")
            return condition()
        return wait_until(checked, timeout, what, interval=POLL_S, on_timeout=self.tail_logs)

    # ---- the cluster's life -----------------------------------------------------------------

    def _write_config(self) -> None:
        for folder in ("munge", "state", "spool"):
            (self.root / folder).mkdir()
        (self.root / "munge").chmod(0o755)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ctld_port, slurmd_port = free_port(), free_port()
        self.conf.write_text(f"""\
ClusterName=hogshard
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.root / "munge" / "socket"}
StateSaveLocation={self.root / "state"}
SlurmdSpoolDir={self.root / "spool"}
SlurmctldPidFile={self.root / "slurmctld.pid"}
SlurmdPidFile={self.root / "slurmd.pid"}
SlurmctldLogFile={self.root / "slurmctld.log"}
SlurmdLogFile={self.root / "slurmd.log"}
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
PropagateResourceLimits=NONE
ReturnToService=2
MpiDefault=none
MinJobAge=600
KillWait=5
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")

    def start(self) -> None:
        self._write_config()
        socket_path = self.root / "munge" / "socket"
        self._daemon("munged", [
            "munged", "--foreground", f"--socket={socket_path}",
            f"--key-file={self.root / 'munge.key'}", f"--pid-file={self.root / 'munged.pid'}",
            f"--seed-file={self.root / 'munge' / 'seed'}",
            f"--log-file={self.root / 'munged.log'}"])
        self._wait(lambda: subprocess.run(["munge", "-n", "-S", str(socket_path)],
                                          capture_output=True).returncode == 0,
                   30, "munged to answer")
        self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, 60,
                   "slurmctld to answer")
        self._daemon("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(lambda: self.run("sinfo", "-h", "-n", self.node, "-o", "%t",
                                    check=False).stdout.strip() == "idle", 60,
                   f"node {self.node} idle")

    def sbatch(self, script: Path | str, *args: str, options: Sequence[str] = (),
               env: Mapping[str, str] | None = None, name: str = "job") -> BatchJob:
        """Submit ``script`` (arguments ``args``) from the repository's root; its output goes
        to a file of this cluster's folder."""
        output = self.root / f"{name}.job"
        submitted = subprocess.run(
            ["sbatch", "--parsable", f"--chdir={REPO}", f"--output={output}",
             f"--job-name={name}", *options, str(script), *args],
            env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=60)
        assert submitted.returncode == 0, submitted.stderr
        return BatchJob(self, submitted.stdout.strip().split(";")[0], output)

    def stop(self) -> None:
        """Cancel every job, stop the daemons, kill whatever is left of the jobs."""
        try:
            if self.daemons.get("slurmctld") is not None and \
                    self.daemons["slurmctld"].poll() is None:
                jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
                if jobs:
                    self.run("scancel", *jobs, check=False)
                    try:
                        wait_until(lambda: not self.run("squeue", "-h", "-o", "%i",
                                                        check=False).stdout.split(),
                                   60, "every job to end", interval=POLL_S)
                    except AssertionError:
                        pass  # the sweep below ends their processes
        finally:
            for name in ("slurmd", "slurmctld", "munged"):
                if name in self.daemons:
                    _stop_group(self.daemons[name])
            _kill_processes_with(f"SLURM_CONF={self.conf}")
            self.log_dir.mkdir(parents=True, exist_ok=True)
            for path in [*self.root.glob("*.out"), *self.root.glob("*.log"),
                         *self.root.glob("*.job"), self.conf]:
                shutil.copy(path, self.log_dir / path.name)
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop_group(process: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        if process.poll() is not None:
            break
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            continue
    process.wait(STOP_GRACE_S)


def _kill_processes_with(marker: str) -> None:
    """SIGKILL every process whose environment holds ``marker`` (this cluster's SLURM_CONF:
    slurmstepd and every job process inherit it), bar this one."""
    needle = marker.encode() + b"\0"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ or environ.endswith(marker.encode()):
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
