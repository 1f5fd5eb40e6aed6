"""A new user's first hour, with real processes: an address without a scheme is one error
line; a worker that cannot reach its job says where it looked, for how long and why it may
fail (and the scheduler logs a refused handshake); ``hogshard stop`` ends a job with every
process exiting 0; ``--exit-when-done`` ends it once its workers are done; a rank beyond the
job's worker count is refused."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from hogshard.proto.security import generate_keys
from hogshard.proto.transport import RpcChannel
from tests.conftest import PYTHON, REPO
from tests.integration.conftest import start_scheduler

pytestmark = pytest.mark.integration

TRAIN = str(REPO / "tests" / "integration" / "train_worker.py")
#: A worker script that only joins (logging at INFO, as the examples do) and leaves.
JOIN = ("import logging; logging.basicConfig(level=logging.INFO); "
        "from hogshard import PSClient; c = PSClient.from_env(); print('rank', c.rank); c.close()")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, flag", [
    (("status", "--scheduler", "127.0.0.1:17999"), "--scheduler"),
    (("server", "--scheduler", "127.0.0.1:17999"), "--scheduler"),
    (("worker", "--scheduler", "127.0.0.1:17999", "--", "true"), "--scheduler"),
    (("checkpoint", "--scheduler", "127.0.0.1:17999", "ckpt"), "--scheduler"),
    (("scheduler", "--bind", "127.0.0.1:17020"), "--bind"),
    (("server", "--bind", "tcp://127.0.0.1:70000"), "--bind"),
])
def test_an_address_without_a_scheme_or_with_a_bad_port_is_one_error_line(
        procs, args: tuple[str, ...], flag: str) -> None:
    code, output = procs.run("cli", [PYTHON, "-m", "hogshard", *args], timeout=60.0)
    assert code == 2, output
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and flag in errors[0], output
    assert "Traceback" not in output and "CURVE" not in output, output


def test_an_address_from_the_environment_is_checked_too(procs) -> None:
    code, output = procs.run("cli", [PYTHON, "-m", "hogshard", "status"], timeout=60.0,
                             env={"HOGSHARD_SCHEDULER": "localhost:7000"})
    assert code == 2 and "HOGSHARD_SCHEDULER" in output and "no scheme" in output, output


def test_a_worker_at_a_wrong_port_names_the_address_and_the_likely_causes(procs) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    code, output = procs.run("worker", [PYTHON, "-c", JOIN], timeout=60.0, env={
        "HOGSHARD_SCHEDULER": address, "HOGSHARD_CONNECT_TIMEOUT": "1"})
    assert code == 1, output
    assert f"registering with the scheduler at {address}" in output, output
    last = output.strip().splitlines()[-1]
    assert address in last and "after 1 s" in last and "nothing listening" in last, output
    assert "pass --keys" in last, output
    assert "AttributeError" not in output and "Exception ignored" not in output, output


def test_a_worker_with_another_clusters_keys_is_told_and_the_scheduler_logs_it(
        procs, tmp_path: Path) -> None:
    keys, other = tmp_path / "keys", tmp_path / "other"
    generate_keys(keys)
    generate_keys(other)
    scheduler, address = start_scheduler(procs, tmp_path, "--keys", str(keys))
    code, output = procs.run("worker", [PYTHON, "-c", JOIN], timeout=60.0, env={
        "HOGSHARD_SCHEDULER": address, "HOGSHARD_KEYS": str(other),
        "HOGSHARD_CONNECT_TIMEOUT": "2"})
    assert code == 1, output
    assert f"the keys in {other} may not be this cluster's" in output, output
    assert "AttributeError" not in output, output
    scheduler.wait_for_output(r"WARNING .*refused a CURVE handshake from 127\.0\.0\.1", 10.0)
    assert scheduler.alive(), scheduler.tail()


def test_a_worker_waiting_for_servers_says_how_many_are_up(procs, tmp_path: Path) -> None:
    _, address = start_scheduler(procs, tmp_path, "--servers", "2")
    code, output = procs.run("worker", [PYTHON, "-c", JOIN], timeout=60.0, env={
        "HOGSHARD_SCHEDULER": address, "HOGSHARD_CONNECT_TIMEOUT": "1"})
    assert code == 1, output
    assert "0 of 2 servers up" in output and "0 of 2 servers had registered" in output, output
    assert "AttributeError" not in output, output


def test_stop_ends_a_job_with_a_final_checkpoint_and_every_process_exits_0(
        procs, cluster_factory, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    cluster = cluster_factory(servers=2, scheduler_args=("--checkpoint-dir", str(ckpt)))
    worker = procs.hogshard("worker", "worker", "--scheduler", cluster.address, "--", PYTHON,
                            TRAIN, "--steps", "100000", "--step-delay", "0.02")
    worker.wait_for_output(r"step 3 ", 60.0)
    code, output = procs.run("stop", [PYTHON, "-m", "hogshard", "stop", "--scheduler",
                                      cluster.address], timeout=60.0)
    assert code == 0 and "1 live worker told to stop" in output, output
    assert worker.wait(60.0) == 0, worker.tail()
    assert "Traceback" not in worker.output(), worker.tail()
    for server in cluster.servers:
        assert server.wait(60.0) == 0, server.tail()
    assert cluster.scheduler.wait(60.0) == 0, cluster.scheduler.tail()
    assert (ckpt / "LATEST").exists(), cluster.scheduler.tail()
    assert "final checkpoint" in cluster.scheduler.output(), cluster.scheduler.tail()


def test_exit_when_done_ends_the_job_once_every_worker_finished(procs, cluster_factory) -> None:
    cluster = cluster_factory(servers=1, scheduler_args=("--num-workers", "2",
                                                         "--exit-when-done"))
    workers = [procs.hogshard(f"worker{i}", "worker", "--scheduler", cluster.address,
                              "--num-workers", "2", "--", PYTHON, TRAIN, "--steps", "3")
               for i in range(2)]
    for worker in workers:
        assert worker.wait(90.0) == 0, worker.tail()
    assert cluster.servers[0].wait(60.0) == 0, cluster.servers[0].tail()
    assert cluster.scheduler.wait(60.0) == 0, cluster.scheduler.tail()
    assert "all 2 workers finished" in cluster.scheduler.output()


def test_a_rank_beyond_the_jobs_workers_is_refused_and_a_freed_rank_handed_out_again(
        procs, cluster_factory) -> None:
    cluster = cluster_factory(servers=1, scheduler_args=("--num-workers", "2"))
    env = {"HOGSHARD_SCHEDULER": cluster.address}
    # a check worker takes rank 0 and leaves; the two workers of the resumed job get 1 and 0
    for expected in (0, 1, 0):
        code, output = procs.run("worker", [PYTHON, "-c", JOIN],
                                 timeout=60.0, env=env)
        assert code == 0 and f"rank {expected}" in output, output
    code, output = procs.run("worker", [PYTHON, "-c", JOIN], timeout=60.0,
                             env={**env, "HOGSHARD_RANK": "2"})
    assert code == 1 and "rank 2 is not a rank of this job: it has 2 workers" in output, output


def test_a_replicated_start_has_no_warnings_and_no_not_owner(procs, cluster_factory) -> None:
    # a slow heartbeat: servers learn a new table's roles up to a second after it is declared
    cluster = cluster_factory(servers=2, heartbeat_interval=1.0, heartbeat_timeout=6.0,
                              scheduler_args=("--replication", "2"))
    worker = procs.hogshard("worker", "worker", "--scheduler", cluster.address, "--", PYTHON,
                            TRAIN, "--steps", "5")
    assert worker.wait(90.0) == 0, worker.tail()
    servers = cluster.members("server")
    assert all(not m["stats"].get("errors") for m in servers), servers
    for proc in [cluster.scheduler, *cluster.servers]:
        assert " WARNING " not in proc.output(), proc.tail()


def test_a_replicated_table_is_declared_once_its_servers_know_the_map(
        cluster_factory, zmq_ctx) -> None:
    cluster = cluster_factory(servers=2, heartbeat_interval=0.2, heartbeat_timeout=8.0,
                              scheduler_args=("--replication", "2"))
    worker = RpcChannel(zmq_ctx, cluster.address, sender="worker-?")
    try:
        node = worker.call("register", {"role": "worker"}, timeout=10.0).get("node_id")
        worker.sender = node
        for server in cluster.servers:  # they cannot learn the table's roles meanwhile
            server.signal_group(signal.SIGSTOP)
        try:
            request = worker.start("declare_table", {"table": "t", "size": 8,
                                                     "rule": {"rule": "sgd", "lr": 0.1}})
            # without the wait, the reply came at once and the worker's first pull or push
            # reached a primary that did not know it was one (NOT_OWNER)
            assert not worker.socket.poll(1000), "declared before the servers knew the map"
        finally:
            for server in cluster.servers:
                server.signal_group(signal.SIGCONT)
        assert worker.socket.poll(10_000), "no declare_table reply once the servers went on"
        reply = worker.read_reply()
        assert reply is not None and reply.request_id == request and reply.op == "ok", reply
    finally:
        worker.close()


def test_stop_releases_a_worker_waiting_at_a_barrier(procs, cluster_factory) -> None:
    cluster = cluster_factory(servers=1)
    script = ("from hogshard import PSClient; c = PSClient.from_env(); print('waiting', "
              "flush=True); c.barrier('end', ranks=2, timeout=60.0); print('released')")
    worker = procs.spawn("worker", [PYTHON, "-c", script],
                         env={"HOGSHARD_SCHEDULER": cluster.address})
    worker.wait_for_output(r"waiting", 60.0)
    code, output = procs.run("stop", [PYTHON, "-m", "hogshard", "stop", "--scheduler",
                                      cluster.address], timeout=60.0)
    assert code == 0, output
    assert worker.wait(30.0) == 0, worker.tail()  # not 60 s later, not with a traceback
    assert "released" not in worker.output() and "Traceback" not in worker.output()
    assert cluster.scheduler.wait(60.0) == 0, cluster.scheduler.tail()
