"""Faults with real processes: a worker SIGKILLed in the middle of an SSP job, and the local
launcher stopped with SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from hogshard.proto.errors import HogshardError

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
TRAIN_WORKER = str(Path(__file__).with_name("train_worker.py"))

HEARTBEAT_INTERVAL = 0.2
HEARTBEAT_TIMEOUT = 1.5
#: Slack on top of the heartbeat timeout for the scheduler to notice (its loop wakes at least
#: every heartbeat interval) and for our status polling, on a loaded 2-core machine.
DETECTION_MARGIN_S = 1.5
SURVIVOR_STEPS = 60
KILL_AFTER_CLOCK = 6
VICTIM_STEP_DELAY_S = 0.05  # ~20 steps/s: under ssp:1 the others cannot outrun it


def _clocks(proc) -> list[int]:
    """The clocks a train_worker.py process has printed so far."""
    return [int(c) for c in re.findall(r"^step \d+ clock (\d+)", proc.output(), re.MULTILINE)]


@pytest.mark.integration
@pytest.mark.timeout(120, method="signal")
def test_killed_worker_is_declared_dead_and_ssp_goes_on(procs, tmp_path: Path) -> None:
    """3 workers train under ssp:1; worker 2 (which would train forever) is SIGKILLed once it
    has made progress. The scheduler must declare it dead within the heartbeat timeout (plus a
    margin), and the two others, held back by SSP while it lived, must then finish their
    steps and exit 0 (no deadlock on the lost worker)."""
    import zmq

    from hogshard.proto.transport import RpcChannel

    address_file = tmp_path / "scheduler.address"
    scheduler = procs.hogshard(
        "scheduler", "scheduler", "--bind", "tcp://127.0.0.1:0", "--address-file",
        str(address_file), "--policy", "ssp:1", "--servers", "2",
        "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
        "--heartbeat-interval", str(HEARTBEAT_INTERVAL),
    )
    procs.wait_until(lambda: address_file.exists() or not scheduler.alive(), 30.0,
                     "the scheduler's address file", on_timeout=scheduler.tail)
    assert scheduler.alive(), scheduler.tail()
    address = address_file.read_text().strip()
    servers = [procs.hogshard(f"server{i}", "server", "--scheduler", address) for i in range(2)]

    def worker(rank: int, steps: int, *extra: str):
        # the start barrier: every server counts all three (and the victim's clock) before
        # anyone's first step, so SSP holds the survivors from the start
        argv = [PYTHON, TRAIN_WORKER, "--steps", str(steps), "--start-barrier", "start", *extra]
        return procs.spawn(f"worker{rank}", argv, env={
            "HOGSHARD_SCHEDULER": address, "HOGSHARD_RANK": str(rank),
            "HOGSHARD_NUM_WORKERS": "3",
        })

    survivors = [worker(0, SURVIVOR_STEPS), worker(1, SURVIVOR_STEPS)]
    # Never finishes on its own; paced, so that the others stay far from their last step.
    victim = worker(2, 1_000_000, "--step-delay", str(VICTIM_STEP_DELAY_S))

    context = zmq.Context()
    channel = RpcChannel(context, address, sender="test")
    try:
        def status() -> dict:
            return channel.call("status", timeout=5.0).header

        def member(node_id: str) -> dict | None:
            return next((m for m in status()["members"] if m["node_id"] == node_id), None)

        # The victim has made progress: it printed a clock > 5 (so it is in the SSP window).
        def victim_clock() -> int:
            assert victim.alive(), f"worker 2 exited early\n{procs.report()}"
            return max(_clocks(victim), default=0)

        procs.wait_until(lambda: victim_clock() >= KILL_AFTER_CLOCK, 60.0,
                         f"worker 2 to reach clock {KILL_AFTER_CLOCK}", on_timeout=procs.report)
        before = member("worker-2")
        assert before is not None and before["state"] == "alive", before
        assert all(p.alive() for p in [scheduler, *servers, *survivors]), procs.report()
        # SSP (s=1) holds the others near the victim's clock: far from their last step.
        assert all(p.alive() for p in survivors), procs.report()

        victim.signal_group(signal.SIGKILL)
        killed_at = time.monotonic()
        assert victim.wait(10.0) == -signal.SIGKILL
        last_victim_clock = max(_clocks(victim))
        assert last_victim_clock >= KILL_AFTER_CLOCK
        # SSP held the others back: at most 1 step ahead of the victim's clock (whose last push
        # may have landed without its line being printed: one more).
        held = [max(_clocks(p), default=0) for p in survivors]
        assert all(c <= last_victim_clock + 2 for c in held), (held, last_victim_clock)

        def declared_dead() -> dict | None:
            try:
                found = member("worker-2")
            except HogshardError:
                return None
            return found if found is not None and found["state"] == "dead" else None

        dead = procs.wait_until(declared_dead, HEARTBEAT_TIMEOUT + DETECTION_MARGIN_S + 5.0,
                                "the scheduler to declare worker-2 dead",
                                on_timeout=procs.report)
        detected_after = time.monotonic() - killed_at
        print(f"worker-2 killed at clock {last_victim_clock} (others at {held}); declared dead "
              f"{detected_after:.2f} s later, heartbeat age {dead['heartbeat_age']:.2f} s")
        assert detected_after <= HEARTBEAT_TIMEOUT + DETECTION_MARGIN_S, (
            f"worker-2 declared dead {detected_after:.2f} s after SIGKILL; heartbeat timeout "
            f"is {HEARTBEAT_TIMEOUT} s"
        )
        # It was declared dead for its silence, not early: its last heartbeat is older than the
        # timeout.
        assert dead["heartbeat_age"] > HEARTBEAT_TIMEOUT, dead

        for proc in survivors:
            code = proc.wait(60.0)
            assert code == 0, f"{proc.name} exited with {code}\n{proc.tail()}"
            assert f"done clock {SURVIVOR_STEPS}" in proc.output(), proc.tail()
        # They went well past where SSP would have held them had the victim stayed "alive".
        assert SURVIVOR_STEPS > last_victim_clock + 2 + 10, last_victim_clock

        final = {m["node_id"]: m for m in status()["members"]}
        assert final["worker-2"]["state"] == "dead", final
        assert final["worker-0"]["state"] in ("done", "alive"), final
        assert final["worker-1"]["state"] in ("done", "alive"), final
        assert all(final[f"server-{r}"]["state"] == "alive" for r in (0, 1)), final
        assert all(p.alive() for p in [scheduler, *servers]), procs.report()
    finally:
        channel.close()
        context.destroy(linger=0)


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_sigterm_to_launcher_stops_its_children(procs, tmp_path: Path) -> None:
    """SIGTERM to ``hogshard launch`` (e.g. from a CI timeout or ``kill``) must stop the job:
    its scheduler, servers and workers are gone shortly after the launcher is.

    Regression guard: it protects the launcher's SIGTERM handler; without one the launcher
    died without running its cleanup and orphaned its children, each in a session of its own."""
    marker = tmp_path / "worker-started"
    worker = ("import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); "
              "time.sleep(120)")  # a worker that runs until it is stopped
    launcher = procs.hogshard("launch", "launch", "--servers", "1", "--workers", "1",
                              "--no-progress", "--", PYTHON, "-c", worker, str(marker))
    procs.wait_until(lambda: marker.exists(), 60.0, "the worker to start",
                     on_timeout=launcher.tail)
    def launched() -> dict[int, str] | None:
        found = procs.descendants(launcher.pid)
        return found if len(found) >= 3 else None

    children = procs.wait_until(launched, 10.0, "the launcher's scheduler, server and worker",
                                on_timeout=launcher.tail)
    procs.adopt(children)  # reaped at teardown whatever the launcher does

    os.kill(launcher.pid, signal.SIGTERM)  # the launcher only, as `kill PID` does
    launcher.wait(15.0)

    def still_running() -> list[int]:
        return [pid for pid, started in children.items()
                if procs.signal_if_same(pid, started, 0)]

    try:
        # The launcher's own grace for its children is 5 s.
        procs.wait_until(lambda: not still_running(), 6.0,
                         "the launcher's children to stop after SIGTERM")
    except AssertionError:
        raise AssertionError(
            f"after SIGTERM to the launcher (exit {launcher.returncode}), its children "
            f"{still_running()} are still running\n{launcher.tail()}"
        ) from None
