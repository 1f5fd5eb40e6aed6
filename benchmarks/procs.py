"""The benchmarks' child processes: start them with their output in a log file, wait for the
file a child writes when it is ready (its address), and stop every one of them at exit.

    from procs import reap, spawn, wait_file   # this script's folder is on sys.path

    proc = spawn([sys.executable, "-m", "hogshard", "scheduler", "--address-file", str(addr)],
                 workdir / "scheduler.log")
    address = wait_file(addr, proc, workdir / "scheduler.log")
    ...
    reap()   # also runs at exit
"""

from __future__ import annotations

import atexit
import subprocess
import time
from pathlib import Path

_children: list[subprocess.Popen] = []


def stop(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """SIGTERM ``proc`` if it still runs, SIGKILL it after ``timeout`` seconds; wait for it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


def reap() -> None:
    """Stop every child :func:`spawn` started that still runs (SIGTERM, then SIGKILL)."""
    while _children:
        stop(_children.pop())


atexit.register(reap)


def spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``argv`` with stdout and stderr in ``log_path``; :func:`reap` stops it."""
    log = open(log_path, "wb")  # noqa: SIM115 - closed when the child is reaped (at exit)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env)
    _children.append(proc)
    return proc


def newest() -> subprocess.Popen:
    """The child :func:`spawn` started last (e.g. to read its CPU time)."""
    return _children[-1]


def wait_file(path: Path, proc: subprocess.Popen, log_path: Path | None = None,
              timeout: float = 60.0) -> str:
    """The stripped text of ``path`` once ``proc`` has written it; RuntimeError (with the
    child's log) if the child exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            log = log_path.read_text() if log_path is not None and log_path.exists() else ""
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}:\n{log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args} wrote no {path.name} within {timeout} s")
        time.sleep(0.02)
    return path.read_text().strip()
