"""The processes of a job launched on this host (``hogshard launch``): the environment a
worker command runs in, each child's output prefixed with its role and rank, the progress
line that follows the workers' reported progress, and the shutdown of every child.

Example::

    output = JobOutput(sys.stdout, progress=True)
    child = spawn(output, "worker", 0, ["python", "train.py"], worker_environment(address, 0))
    stop_children([child])
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from hogshard.proto.config import env_name
from hogshard.status import ClusterView
from hogshard.tuning import with_malloc_settings


def worker_environment(
    scheduler: str, rank: int | None = None, num_workers: int | None = None,
    threads: int | None = None, base: dict[str, str] | None = None, codec: str | None = None,
    keys: str | None = None,
) -> dict[str, str]:
    """The environment a worker command runs in (what ``PSClient.from_env`` reads)."""
    env = dict(os.environ if base is None else base)
    env[env_name("scheduler")] = scheduler
    if rank is not None:
        env[env_name("rank")] = str(rank)
    if num_workers is not None:
        env[env_name("num_workers")] = str(num_workers)
    if codec:
        env[env_name("codec")] = codec
    if keys:
        env[env_name("keys")] = str(Path(keys).resolve())
    if threads is not None:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", env_name("torch_threads")):
            env.setdefault(var, str(threads))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return with_malloc_settings(env)


@dataclass
class Child:
    role: str
    rank: int
    process: subprocess.Popen
    reader: threading.Thread | None = None
    replaced: bool = False  # a server that exited and was replaced (--replication 2)

    @property
    def label(self) -> str:
        return f"{self.role} {self.rank}"


class JobOutput:
    """The launcher's output: lines of the children and its own, and a progress bar (tqdm on
    a terminal, else a line every 10 s) when ``progress``."""

    def __init__(self, out: IO[str], progress: bool) -> None:
        self.out = out
        self.progress = progress
        self._lock = threading.Lock()
        self._bar: Any = None
        self._last_line = 0.0

    def emit(self, text: str) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.write(text, file=self.out)
            else:
                self.out.write(text + "\n")
                self.out.flush()

    def pipe(self, child: Child) -> None:
        """Copy ``child``'s output, each line prefixed with its label (until it closes)."""
        assert child.process.stdout is not None
        for line in child.process.stdout:
            self.emit(f"[{child.label}] {line.rstrip()}")

    def open_bar(self) -> None:
        if not self.progress:
            return
        from tqdm import tqdm

        self._bar = tqdm(total=1, unit="step", file=self.out, dynamic_ncols=True,
                         mininterval=0.5, disable=None if not self.out.isatty() else False)
        if self._bar.disable:
            self._bar = None
            self._last_line = 0.0

    def update_bar(self, view: ClusterView) -> None:
        done, total = view.progress()
        if total <= 0:
            return
        postfix = view.postfix()
        if self._bar is not None:
            self._bar.total = total
            self._bar.n = done
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.refresh()
        elif self.progress and time.monotonic() - self._last_line >= 10.0:
            self._last_line = time.monotonic()
            self.emit(f"[launch] progress {done}/{total} ({100 * done / total:.0f}%) {postfix}")

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


#: ``prctl`` option: the signal the kernel sends a process when its parent dies (Linux).
PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send the child SIGTERM when the process that
    started it dies, however it dies (SIGKILL included), so that no child of a killed
    launcher runs on; None where ``prctl`` is not there (not Linux). The C library is loaded
    here, before the fork, so that the child only makes the call.

    >>> die_with_parent() is None or callable(die_with_parent())
    True
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: nobody would tell us
            os.kill(os.getpid(), signal.SIGTERM)

    return in_child


def spawn(output: JobOutput, role: str, rank: int, argv: Sequence[str],
          env: dict[str, str]) -> Child:
    """Start ``argv`` in a session of its own, its output copied to ``output``; it is sent
    SIGTERM if this process dies (:func:`die_with_parent`)."""
    process = subprocess.Popen(
        list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True,
        preexec_fn=die_with_parent(),
    )
    child = Child(role, rank, process)
    child.reader = threading.Thread(target=output.pipe, args=(child,), daemon=True)
    child.reader.start()
    return child


def stop_children(children: Sequence[Child], grace: float = 5.0) -> None:
    """SIGTERM to every live child's process group, SIGKILL to those still up after
    ``grace`` seconds; then wait for their output readers."""
    alive = [c for c in children if c.process.poll() is None]
    for child in alive:
        _signal_group(child.process, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in alive:
        try:
            child.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(child.process, signal.SIGKILL)
            child.process.wait()
    for child in children:
        if child.reader is not None:
            child.reader.join(timeout=2.0)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
