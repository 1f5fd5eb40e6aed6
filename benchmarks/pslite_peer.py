"""Run a ps-lite benchmark binary beside ``pushpull.py`` (``--peer pslite PATH``): nothing is
built here, the binary is given by path.

The binary is ps-lite's ``tests/test_benchmark.cc`` (or one with the same interface): one
executable for every role, chosen by ``DMLC_ROLE``, arguments ``LEN REPEAT MODE`` (MODE 2: push
only, 3: pull only), and a worker that logs ``Application goodput: G Gbps`` every
``LOG_DURATION`` rounds until ``TOTAL_DURATION`` rounds are done, with ``NUM_KEY_PER_SERVER``
keys of ``LEN`` bytes each. This module starts a scheduler, one server and one worker of it on
127.0.0.1 (a free port), one key of the payload size, and returns the goodputs the worker
logged, in MB/s (1 MB = 10**6 bytes). Whatever update the binary's server handler does is the
binary's (stock ps-lite's handler does none; build it with an SGD handler to compare updates).

Example::

    rates = pslite_rates("/opt/ps-lite/build/test_benchmark", 1 << 20, "push", samples=5,
                         workdir=Path("/tmp"))
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

MODES = {"push": 2, "pull": 3}
GOODPUT = re.compile(r"Application goodput: ([0-9.eE+-]+) Gbps")
BYTES_PER_SAMPLE = 64 << 20  # each logged sample moves at least this much
TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pslite_rates(binary: str, nbytes: int, op: str, samples: int, workdir: Path) -> list[float]:
    """The ps-lite worker's goodputs (MB/s) pushing or pulling one ``nbytes`` key."""
    rounds = max(2, BYTES_PER_SAMPLE // nbytes)
    env = {**os.environ, "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1",
           "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(_free_port()),
           "NUM_KEY_PER_SERVER": "1", "LOG_DURATION": str(rounds),
           "TOTAL_DURATION": str(rounds * samples)}
    argv = [binary, str(nbytes), "1", str(MODES[op])]
    procs: dict[str, subprocess.Popen] = {}
    logs = {role: workdir / f"pslite-{role}.log" for role in ("scheduler", "server", "worker")}
    try:
        for role, log in logs.items():
            with open(log, "wb") as out:
                procs[role] = subprocess.Popen(argv, env={**env, "DMLC_ROLE": role}, stdout=out,
                                               stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL)
        code = procs["worker"].wait(TIMEOUT_S)
        text = logs["worker"].read_text(errors="replace")
        rates = [float(g) * 1e9 / 8 / 1e6 for g in GOODPUT.findall(text)]
        if code != 0 or not rates:
            raise RuntimeError(f"ps-lite worker {argv} exited with {code} after logging "
                               f"{len(rates)} goodputs:\n{text[-2000:]}")
        return rates
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
