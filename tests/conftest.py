"""Shared test infrastructure: real OS processes that are always reaped.

``procs`` (a :class:`ProcessManager`) spawns children with ``subprocess.Popen`` in their own
session (so each child and everything it starts is one process group), sends their output to a
log file under the test's ``tmp_path``, and at teardown ALWAYS ends every group it started:
SIGTERM, a short grace, then SIGKILL, even when the test failed or timed out. When a test fails,
the tail of every child's log is printed so the failure can be read without rerunning.

Every wait here takes a deadline; nothing sleeps where an event can be awaited (conditions are
polled with a deadline instead).
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TERM_GRACE_S = 3.0
POLL_S = 0.05

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T], timeout: float, what: str, interval: float = POLL_S,
    on_timeout: Callable[[], str] | None = None,
) -> T:
    """Poll ``condition`` until it returns something truthy (returned) or ``timeout`` passes
    (AssertionError naming ``what``, with ``on_timeout()`` appended for context)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            extra = f"\n{on_timeout()}" if on_timeout is not None else ""
            raise AssertionError(f"timed out after {timeout:.1f} s waiting for {what}{extra}")
        time.sleep(interval)


#: ``HOGSHARD_TEST_UPDATE_THREADS=1 pytest tests/integration`` gives every child
#: ``HOGSHARD_UPDATE_THREADS=1`` (servers apply updates on a thread).
TEST_UPDATE_THREADS = "HOGSHARD_TEST_UPDATE_THREADS"
#: ``HOGSHARD_TEST_SHM_MIN_BYTES=4 pytest tests/integration`` sends every chunk between
#: co-located workers and servers through shared memory (``HOGSHARD_SHM_MIN_BYTES``), in
#: children and in the test process's own clients.
TEST_SHM_MIN_BYTES = "HOGSHARD_TEST_SHM_MIN_BYTES"
if os.environ.get(TEST_SHM_MIN_BYTES):
    os.environ["HOGSHARD_SHM_MIN_BYTES"] = os.environ[TEST_SHM_MIN_BYTES]


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child: ours without any ``HOGSHARD_*`` variable (a developer's or
    CI's settings must not leak into a test), single-threaded maths, unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOGSHARD_")}
    if os.environ.get(TEST_UPDATE_THREADS):  # run the suite's servers with update threads
        env["HOGSHARD_UPDATE_THREADS"] = os.environ[TEST_UPDATE_THREADS]
    if os.environ.get(TEST_SHM_MIN_BYTES):
        env["HOGSHARD_SHM_MIN_BYTES"] = os.environ[TEST_SHM_MIN_BYTES]
    env.update({
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "HOGSHARD_TORCH_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra or {})
    return env


def _start_time(pid: int) -> str | None:
    """A process's start time (field 22 of /proc/PID/stat), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else fields[19]


def descendants(root: int) -> dict[int, str]:
    """Every live descendant of ``root`` as {pid: start time}, from /proc (empty elsewhere)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                started = _start_time(pid)
                if started is not None:
                    found[pid] = started
                    frontier.append(pid)
    return found


def signal_if_same(pid: int, started: str, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the process that started at ``started``
    (``sig`` 0 only asks). Returns whether that process is still there."""
    if _start_time(pid) != started:
        return False
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class Proc:
    """One spawned child: its Popen, its log file, and bounded waits on both."""

    def __init__(self, name: str, argv: Sequence[str], popen: subprocess.Popen, log: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.popen = popen
        self.log = log

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 40) -> str:
        text = self.output().splitlines()[-lines:]
        state = "running" if self.alive() else f"exit code {self.popen.returncode}"
        header = f"----- {self.name} (pid {self.pid}, {state}): {' '.join(self.argv)}"
        return "\n".join([header, *text])

    def wait(self, timeout: float) -> int:
        """The exit code; AssertionError (with the log's tail) if still running at the deadline."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} still running after {timeout:.1f} s\n{self.tail()}"
            ) from None

    def wait_for_output(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first match of the regex ``pattern`` in the log; fails early if the process
        exits without printing it."""
        regex = re.compile(pattern, re.MULTILINE)

        def found() -> re.Match[str] | None:
            match = regex.search(self.output())
            if match is None and not self.alive():
                match = regex.search(self.output())  # it may have printed it just before exiting
                if match is None:
                    raise AssertionError(
                        f"{self.name} exited ({self.popen.returncode}) without printing "
                        f"{pattern!r}\n{self.tail()}"
                    )
            return match

        return wait_until(found, timeout, f"{self.name} to print {pattern!r}",
                          on_timeout=self.tail)

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class ProcessManager:
    """Spawns children for one test and reaps every one of them."""

    wait_until = staticmethod(wait_until)
    descendants = staticmethod(descendants)
    signal_if_same = staticmethod(signal_if_same)

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.children: list[Proc] = []
        self.adopted: dict[int, str] = {}
        atexit.register(self.cleanup)  # a last resort if teardown never runs

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: Path = REPO,
    ) -> Proc:
        log = self.workdir / f"{len(self.children):02d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.log"
        handle = log.open("wb")
        try:
            popen = subprocess.Popen(
                list(argv), cwd=cwd, env=clean_env(env), stdin=subprocess.DEVNULL,
                stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
            )
        finally:
            handle.close()  # the child holds its own descriptor
        proc = Proc(name, argv, popen, log)
        self.children.append(proc)
        return proc

    def hogshard(self, name: str, *args: str, env: Mapping[str, str] | None = None) -> Proc:
        """``python -m hogshard ARGS`` with this interpreter."""
        return self.spawn(name, [PYTHON, "-m", "hogshard", *args], env)

    def run(self, name: str, argv: Sequence[str], timeout: float,
            env: Mapping[str, str] | None = None) -> tuple[int, str]:
        """Spawn, wait for the exit (bounded) and return (exit code, output)."""
        proc = self.spawn(name, argv, env)
        code = proc.wait(timeout)
        return code, proc.output()

    def cleanup(self) -> None:
        """SIGTERM every group still running, a short grace, then SIGKILL; reap them all.

        Processes a child started in sessions of their own (the launcher's scheduler, servers
        and workers) are not in the child's group: they are found through /proc before the
        child is signalled, and ended by pid too (checked against their start time, so a
        recycled pid is never hit)."""
        running = [p for p in self.children if p.alive()]
        extra: dict[int, str] = dict(self.adopted)
        for proc in running:
            extra.update(descendants(proc.pid))
        for proc in running:
            proc.signal_group(signal.SIGTERM)
        for pid, started in extra.items():
            signal_if_same(pid, started, signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        for proc in running:
            try:
                proc.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        while extra and time.monotonic() < deadline and any(
            signal_if_same(pid, started, 0) for pid, started in extra.items()
        ):
            time.sleep(POLL_S)
        for proc in running:
            # Also what a child left behind in its own group after it exited.
            proc.signal_group(signal.SIGKILL)
            try:
                proc.popen.wait(5.0)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable process
                pass
        for pid, started in extra.items():
            if signal_if_same(pid, started, 0):
                signal_if_same(pid, started, signal.SIGKILL)
        atexit.unregister(self.cleanup)

    def adopt(self, processes: Mapping[int, str]) -> None:
        """Have cleanup end these processes too ({pid: start time}, from ``descendants``):
        grandchildren that may outlive the child that started them."""
        self.adopted.update(processes)

    def report(self) -> str:
        return "\n".join(p.tail() for p in self.children)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    """Keep each phase's report on the item, so fixtures can tell whether the test failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture
def procs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ProcessManager]:
    manager = ProcessManager(tmp_path)
    try:
        yield manager
    finally:
        failed = any(
            getattr(getattr(request.node, f"rep_{when}", None), "failed", False)
            for when in ("setup", "call")
        )
        if failed and manager.children:
            print("\n===== logs of the processes this test started =====")
            print(manager.report())
        manager.cleanup()


# ---- devices --------------------------------------------------------------------------------

#: Every device a worker-side test that touches tensors runs on (the ``device`` fixture).
DEVICES = ("cpu", "cuda")


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """``"cpu"``, then ``"cuda"`` where torch sees a CUDA device (skipped, with the reason,
    elsewhere). torch is imported only by tests that use the fixture."""
    name = str(request.param)
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            build = torch.version.cuda or "a CPU-only build"
            pytest.skip(f"no CUDA device visible to torch {torch.__version__} ({build})")
    return name
