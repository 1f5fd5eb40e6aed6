"""What the status page costs the scheduler's control plane: round trips of a light op
(``get_table``) and of ``status`` to a scheduler without a page, against a scheduler with
``--http-port`` whose page is open and polled (``/api/page`` every ``--poll-interval`` s, four
times the page's own rate: several tabs open).

Both jobs (scheduler, ``--servers`` servers, one worker that declared a table and keeps
pushing so that the servers' heartbeats carry changing counters) run at once as subprocesses;
rounds alternate between them (``--rounds``, the first job measured first in every other
round), and the table shows the median latency of each and the ratio (page/no page) over the
rounds' medians, and each scheduler's CPU time over the measured rounds (cores busy: less
disturbed by load than wall time). Load of the machine is printed with it.

Usage::

    .venv/bin/python benchmarks/status_page.py --quick
    .venv/bin/python benchmarks/status_page.py --json /tmp/status_page.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from hogshard.proto.config import ClientSettings
from hogshard.proto.transport import RpcChannel
from hogshard.worker.client import PSClient

POLLER = """
import sys, time, urllib.request
url, every = sys.argv[1], float(sys.argv[2])
times = []
while True:
    t = time.perf_counter()
    try:
        urllib.request.urlopen(url, timeout=5).read()
    except OSError:
        break
    times.append(time.perf_counter() - t)
    sys.stdout.write(f"{times[-1] * 1e3:.3f}\\n"); sys.stdout.flush()
    time.sleep(every)
"""


def start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "hogshard", "--log-level", "WARNING", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_line(proc: subprocess.Popen, pattern: str, timeout: float = 60.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        match = re.search(pattern, line)
        if match:
            return match
    raise RuntimeError(f"no line matching {pattern!r} from {proc.args}")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Job:
    """A scheduler (with or without the page), its servers and a pushing worker."""

    def __init__(self, page: bool, servers: int, elems: int, context: zmq.Context) -> None:
        self.port = free_port() if page else 0
        extra = ["--http-port", str(self.port), "--http-host", "127.0.0.1"] if page else []
        self.procs = [start(["scheduler", "--bind", "tcp://127.0.0.1:0", "--servers",
                             str(servers), "--heartbeat-interval", "0.2", *extra])]
        self.address = wait_line(self.procs[0], r"listening on (tcp://\S+)").group(1)
        self.procs += [start(["server", "--scheduler", self.address]) for _ in range(servers)]
        self.client = PSClient(ClientSettings(scheduler=self.address, connect_timeout=60.0,
                                              request_timeout=60.0), context)
        self.table = self.client.dense_table("t", elems, {"rule": "sgd", "lr": 1e-9},
                                             init=np.zeros(elems, np.float32))
        self.channel = RpcChannel(context, self.address, sender="bench")
        self._stop = threading.Event()
        self._pusher = threading.Thread(target=self._push, daemon=True)
        self._pusher.start()
        self.poller: subprocess.Popen | None = None
        if page:
            self.poller = subprocess.Popen([sys.executable, "-c", POLLER,
                                            f"http://127.0.0.1:{self.port}/api/page", "0.5"],
                                           stdout=subprocess.PIPE, text=True)

    def _push(self) -> None:
        grads = np.ones(self.table.size, np.float32)
        while not self._stop.is_set():
            self.client.push(self.table, grads).result(60.0)
            self.client.clock += 1
            self.client.set_progress(done=self.client.clock, total=1 << 30, loss=1.0)
            time.sleep(0.01)

    def round_trips(self, op: str, count: int) -> list[float]:
        fields = {"table": "t"} if op == "get_table" else {}
        times = []
        for _ in range(count):
            started = time.perf_counter()
            self.channel.call(op, fields, timeout=30.0)
            times.append(time.perf_counter() - started)
        return times

    def close(self) -> list[float]:
        """Stop everything; the poller's fetch times (ms)."""
        self._stop.set()
        self._pusher.join(30.0)
        self.channel.close()
        self.client.close()
        fetched: list[float] = []
        if self.poller is not None:
            self.poller.terminate()
            fetched = [float(x) for x in self.poller.communicate(timeout=30)[0].split()]
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return fetched


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 rounds of 300 calls per op (~30 s)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--calls", type=int, default=2000, help="round trips per op per round")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--elems", type=int, default=1 << 20, help="table size (floats)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.calls = 4, 300
    context = zmq.Context()
    jobs = {"no page": Job(False, args.servers, args.elems, context),
            "page polled": Job(True, args.servers, args.elems, context)}
    medians: dict[str, dict[str, list[float]]] = {
        mode: {"get_table": [], "status": []} for mode in jobs}
    cpu: dict[str, float | None] = {}
    try:
        for job in jobs.values():  # warm up
            for op in ("get_table", "status"):
                job.round_trips(op, 20)
        cpu_before = {mode: cpu_seconds(job.procs[0].pid) for mode, job in jobs.items()}
        started = time.monotonic()
        for index in range(args.rounds):
            order = list(jobs) if index % 2 == 0 else list(reversed(jobs))
            for mode in order:
                for op in ("get_table", "status"):
                    times = jobs[mode].round_trips(op, args.calls)
                    medians[mode][op].append(statistics.median(times) * 1e3)
        wall = time.monotonic() - started
        for mode, job in jobs.items():
            after, before = cpu_seconds(job.procs[0].pid), cpu_before[mode]
            cpu[mode] = (after - before) / wall if after is not None and before is not None \
                else None
    finally:
        fetched = {mode: job.close() for mode, job in jobs.items()}
        context.term()
    page_fetches = fetched["page polled"]
    load = os.getloadavg()[0]
    print(f"{args.rounds} interleaved rounds x {args.calls} round trips per op; "
          f"{args.servers} servers, one worker pushing {args.elems * 4 / 1e6:.1f} MB; "
          f"load {load:.2f}")
    print(f"{'op':<12}{'no page ms':>12}{'page polled ms':>16}{'ratio':>8}")
    result: dict[str, object] = {"rounds": args.rounds, "calls": args.calls,
                                 "servers": args.servers, "elems": args.elems, "load": load,
                                 "round_medians_ms": medians}
    for op in ("get_table", "status"):
        off = statistics.median(medians["no page"][op])
        on = statistics.median(medians["page polled"][op])
        ratio = statistics.median(b / a for a, b in zip(medians["no page"][op],
                                                          medians["page polled"][op],
                                                          strict=True))
        print(f"{op:<12}{off:>12.3f}{on:>16.3f}{ratio:>8.3f}")
        result[op] = {"no_page_ms": off, "page_ms": on, "ratio": ratio}
    if cpu.get("no page") is not None and cpu.get("page polled") is not None:
        print(f"scheduler CPU (cores busy): no page {cpu['no page']:.3f}, page polled "
              f"{cpu['page polled']:.3f}")
        result["scheduler_cpu_cores"] = cpu
    if page_fetches:
        page_fetches.sort()
        p50 = page_fetches[len(page_fetches) // 2]
        print(f"page fetches: {len(page_fetches)}, /api/page p50 {p50:.2f} ms")
        result["page_fetches"] = len(page_fetches)
        result["page_fetch_p50_ms"] = p50
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
