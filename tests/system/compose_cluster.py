"""A hogshard cluster run through the real docker/docker-compose.yml, for the system tests.

:class:`ComposeCluster` drives ``docker-compose`` (1.29) or ``docker compose`` (v2) with a
project name of its own, waits on what the cluster reports (the scheduler's Prometheus
metrics on the published loopback port, container states from ``docker inspect``), injects
faults (SIGKILL of a container's main process, ``docker kill``/``start``/``restart``, removing
a worker container and starting another) and always takes the project down, volumes included.

Example::

    with ComposeCluster("hs-demo", {"HOGSHARD_REPLICATION": "2"}) as cluster:
        cluster.up(workers=2)
        cluster.wait_for_clock(100, timeout=300)
        cluster.kill_process("server1")
        cluster.wait_workers_done(timeout=600)
        report = cluster.report()
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.conftest import wait_until

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker" / "docker-compose.yml"
METRICS_URL = "http://127.0.0.1:9100/metrics"
POLL_S = 0.5


def compose_command() -> list[str] | None:
    """``docker-compose`` (1.29, Debian's) or ``docker compose`` (v2), whichever works."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(
            ["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


def docker_ready() -> str | None:
    """None when a docker daemon answers and compose is installed, else why not."""
    if shutil.which("docker") is None:
        return "no docker client"
    if compose_command() is None:
        return "neither docker-compose nor the docker compose plugin"
    probe = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"no docker daemon answers: {probe.stderr.strip()[:200]}"
    return None


DEFAULT_BASE_IMAGE = "python:3.11-slim"
DOCKER_ENV = REPO / ".docker-env"  # written by scripts/docker-setup.sh


def _image_exists(image: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", image], capture_output=True,
                          timeout=60).returncode == 0


def read_docker_env(path: Path = DOCKER_ENV) -> dict[str, str]:
    """The ``export NAME=VALUE`` lines of scripts/docker-setup.sh's ``.docker-env``."""
    found = {}
    if path.exists():
        for line in path.read_text().splitlines():
            name, sep, value = line.removeprefix("export ").partition("=")
            if sep and name.startswith("HOGSHARD_"):
                found[name.strip()] = value.strip()
    return found


def base_image_env() -> tuple[dict[str, str], str | None]:
    """What the image builds need to find their base image, the way ``.ci/run`` prepares it:
    ``HOGSHARD_PYTHON_IMAGE`` (and ``HOGSHARD_PIP_ARGS``) from the environment, from a
    ``.docker-env`` an earlier ``scripts/docker-setup.sh`` wrote, ``python:3.11-slim`` where
    it is here or can be pulled, else what ``scripts/docker-setup.sh`` makes from Debian
    packages (as root). Returns the variables and None, or ``{}`` and why no base image can
    be had (the test then skips, or fails under ``HOGSHARD_SYSTEM_TESTS=1``)."""
    if os.environ.get("HOGSHARD_PYTHON_IMAGE"):
        return {}, None
    prepared = read_docker_env()
    if prepared.get("HOGSHARD_PYTHON_IMAGE") and _image_exists(prepared["HOGSHARD_PYTHON_IMAGE"]):
        return prepared, None
    if _image_exists(DEFAULT_BASE_IMAGE) or subprocess.run(
            ["docker", "pull", "-q", DEFAULT_BASE_IMAGE], capture_output=True,
            timeout=180).returncode == 0:
        return {}, None
    if os.geteuid() != 0:
        return {}, (f"no {DEFAULT_BASE_IMAGE} image (Docker Hub unreachable?), and making one "
                    "from Debian packages needs root: run `sudo bash scripts/docker-setup.sh` "
                    "once (as .ci/run does)")
    done = subprocess.run(["bash", str(REPO / "scripts" / "docker-setup.sh")],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return {}, f"scripts/docker-setup.sh failed: {done.stderr.strip()[-500:]}"
    prepared = read_docker_env()
    if not prepared.get("HOGSHARD_PYTHON_IMAGE"):
        return {}, "scripts/docker-setup.sh wrote no HOGSHARD_PYTHON_IMAGE to .docker-env"
    return prepared, None


class ComposeCluster:
    """One compose project of the hogshard cluster; a context manager that tears it down."""

    def __init__(self, project: str, environ: Mapping[str, str], log_dir: Path | None = None):
        compose = compose_command()
        assert compose is not None, "compose is not installed"
        self.project = project
        self.env = {**os.environ, **environ}
        self.base = [*compose, "-f", str(COMPOSE_FILE), "-p", project]
        self.log_dir = log_dir

    # ---- plumbing ---------------------------------------------------------------------------

    def compose(self, *args: str, timeout: float = 300.0, check: bool = True
                ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*self.base, *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)} failed ({done.returncode}):\n"
                                 f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        return done

    def containers(self, service: str, all_states: bool = True) -> list[str]:
        """Container ids of ``service`` (stopped ones too with ``all_states``)."""
        argv = ["docker", "ps", "-q", "--no-trunc",
                "--filter", f"label=com.docker.compose.project={self.project}",
                "--filter", f"label=com.docker.compose.service={service}"]
        if all_states:
            argv.append("-a")
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
        return out.stdout.split()

    def container(self, service: str) -> str:
        ids = self.containers(service)
        assert len(ids) == 1, f"{service}: expected one container, found {ids}"
        return ids[0]

    @staticmethod
    def inspect(container: str) -> dict[str, Any]:
        out = subprocess.run(["docker", "inspect", container], capture_output=True, text=True,
                             timeout=60, check=True)
        return json.loads(out.stdout)[0]

    def wait_until(self, condition: Any, timeout: float, what: str) -> Any:
        return wait_until(condition, timeout, f"{self.project}: {what}", interval=POLL_S,
                          on_timeout=self.tail_logs)

    def metrics(self) -> dict[str, float]:
        """The scheduler's metrics as {'name{labels}': value}; {} while it does not answer."""
        try:
            with urllib.request.urlopen(METRICS_URL, timeout=2.0) as reply:
                text = reply.read().decode()
        except OSError:
            return {}
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                values[key] = float(value)
        return values

    def clocks(self, role: str = "worker") -> dict[str, float]:
        pattern = re.compile(r'hogshard_member_clock\{node_id="([^"]+)",role="' + role + '"}')
        return {m.group(1): v for k, v in self.metrics().items() if (m := pattern.match(k))}

    def members(self, role: str, state: str) -> int:
        return int(self.metrics().get(f'hogshard_members{{role="{role}",state="{state}"}}', 0))

    # ---- the cluster's life -----------------------------------------------------------------

    def up(self, workers: int) -> None:
        self.compose("up", "-d", "--scale", f"worker={workers}", timeout=600)

    def wait_for_clock(self, at_least: int, timeout: float) -> None:
        """Until some worker has done ``at_least`` steps."""
        self.wait_until(lambda: max(self.clocks().values(), default=0) >= at_least, timeout,
                        f"a worker clock >= {at_least}")

    def worker_states(self) -> list[dict[str, Any]]:
        return [self.inspect(c)["State"] for c in self.containers("worker")]

    def wait_workers_done(self, timeout: float) -> list[int]:
        """Until every worker container has exited (and no restart is pending); exit codes."""
        def done() -> list[int] | None:
            states = self.worker_states()
            if states and all(s["Status"] == "exited" for s in states):
                return [int(s["ExitCode"]) for s in states]
            return None
        return self.wait_until(done, timeout, "every worker container to exit")

    def kill_process(self, service: str) -> int:
        """SIGKILL the container's main process from the host (the restart policy brings the
        container back); returns the container's restart count before the kill."""
        container = self.container(service)
        info = self.inspect(container)
        os.kill(int(info["State"]["Pid"]), signal.SIGKILL)
        return int(info["RestartCount"])

    def wait_restarted(self, service: str, restarts_before: int, timeout: float) -> None:
        container = self.container(service)
        self.wait_until(lambda: (info := self.inspect(container))["RestartCount"] > restarts_before
                        and info["State"]["Running"], timeout, f"{service} restarted")

    def docker(self, *args: str) -> None:
        subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120,
                       check=True)

    def read_file(self, service: str, path: str) -> str:
        """A file from a service's container (running or not), through ``docker cp``."""
        done = subprocess.run(["docker", "cp", f"{self.container(service)}:{path}", "-"],
                              capture_output=True, timeout=60, check=True)
        return _untar_one(done.stdout)

    def report(self) -> dict[str, Any]:
        return json.loads(self.read_file("scheduler", "/checkpoints/report.json"))

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service, check=False).stdout

    def acknowledged_by_worker(self) -> list[int]:
        """Each worker's 'N chunk updates acknowledged' line, from every worker container's log."""
        counts = []
        for line in self.logs("worker").splitlines():
            if (m := re.search(r"(\d+) chunk updates acknowledged by the servers", line)):
                counts.append(int(m.group(1)))
        return counts

    def tail_logs(self, lines: int = 40) -> str:
        return self.compose("logs", "--no-color", "--tail", str(lines), check=False).stdout

    def down(self) -> None:
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            (self.log_dir / f"{self.project}.log").write_text(
                self.compose("logs", "--no-color", "--timestamps", check=False).stdout)
        self.compose("down", "-v", "--remove-orphans", "-t", "2", check=False)

    def __enter__(self) -> ComposeCluster:
        self.compose("down", "-v", "--remove-orphans", "-t", "0", check=False)  # a leftover
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()


def _untar_one(data: bytes) -> str:
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = next(m for m in tar.getmembers() if m.isfile())
        extracted = tar.extractfile(member)
        assert extracted is not None
        return extracted.read().decode()
