"""Gradient compression against live processes: a job trained with lossy codecs through
``hogshard launch --codec`` reaches a useful accuracy while pushing a known fraction of the
bytes; a corrupt compressed push gets one ``error`` reply naming the problem while the server
keeps serving; bad ``--codec`` flags are refused before anything starts.

The training cases fall back to scikit-learn's digits when ../shared/data/fashion-mnist is
absent (with that data set's threshold); they are never skipped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from hogshard.proto.config import ClientSettings
from hogshard.worker.client import PSClient
from hogshard.worker.compression import Compressor
from hogshard.worker.compression_policy import CompressionPolicy, TableRule

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "fashion_mnist.py")
PYTHON = sys.executable
REPLY_TIMEOUT_S = 5.0
CLI_TIMEOUT_S = 30.0

#: The optimiser and data of tests/integration/test_training.py (one short epoch).
TRAIN_FLAGS = ["--rule", "adam", "--lr", "0.003", "--batch", "32", "--limit", "6000"]
#: Accuracy a compressed job must reach, by codec and data set (chance is 0.1; uncompressed
#: reaches 0.74-0.78 on fashion-mnist and 0.77-0.94 on digits in this setting). Measured on the
#: loaded 2-core dev machine: topk:0.05 0.6+ on fashion-mnist; sign:256 0.45 on fashion-mnist
#: and 0.53 on digits (error-feedback sign starts slowly: 63 steps a worker here).
MIN_ACCURACY = {"topk:0.05": {"fashion-mnist": 0.6, "sklearn-digits": 0.45},
                "sign:256": {"fashion-mnist": 0.35, "sklearn-digits": 0.35},
                "powersgd:2": {"fashion-mnist": 0.45, "sklearn-digits": 0.35}}
#: powersgd:2 (one server, three workers) reached 0.68 on fashion-mnist in this setting; a
#: threshold of 0.6 failed one run in three.


# ---------------------------------------------------------------------------------------------
# a short job per lossy codec
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
@pytest.mark.parametrize(("codec", "max_fraction", "epochs"),
                         [("topk:0.05", 0.101, 1), ("sign:256", 0.036, 2)])
def test_lossy_codec_trains_with_fewer_bytes(procs, tmp_path: Path, codec: str,
                                             max_fraction: float, epochs: int) -> None:
    """topk:0.05 sends 8 bytes for 5 % of the elements (0.1 of ``none``); sign:256 one bit
    per element plus a float per 256 (1/32 + 1/256 of ``none``). Both with error feedback;
    error-feedback sign starts slowly, so it trains two short epochs (one ended at 0.33 on a
    loaded machine, against 0.45-0.56 elsewhere)."""
    report_path = tmp_path / "report.json"
    from hogshard.datasets import FASHION_MNIST

    digits = not (FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file()
    proc = procs.hogshard(
        f"launch-{codec}", "launch", "--servers", "2", "--workers", "3", "--policy", "async",
        "--codec", codec, "--no-progress", "--", PYTHON, EXAMPLE, *TRAIN_FLAGS,
        "--epochs", str(4 * epochs if digits else epochs), "--report", str(report_path))
    code = proc.wait(120.0)
    assert code == 0, f"hogshard launch exited with {code}\n{proc.tail(80)}"
    report = json.loads(report_path.read_text())
    assert report["codec"] == codec, report
    none_bytes = 4 * report["parameters"]
    fraction = report["bytes_pushed_per_step"] / none_bytes
    assert 0 < fraction <= max_fraction, (
        f"{codec} pushed {report['bytes_pushed_per_step']:.0f} bytes per step, "
        f"{fraction:.4f} of none's {none_bytes}; expected at most {max_fraction}")
    threshold = MIN_ACCURACY[codec][report["dataset"]]
    assert report["test_accuracy"] >= threshold, (
        f"{codec}: {report['dataset']} accuracy {report['test_accuracy']:.4f} < {threshold}; "
        f"report: {report}")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150, method="signal")
def test_powersgd_sends_each_layer_at_its_own_rank(procs, tmp_path: Path) -> None:
    """The worker compresses each weight matrix of the model (conv weights as out x rest) at
    rank 2 and sends biases raw; the server decodes the layers from the codec meta alone. One
    server, so the table is one chunk and the byte count is the layers' exact sum."""
    from hogshard.datasets import FASHION_MNIST
    from hogshard.proto.codecs import PowerSGDCodec
    from hogshard.proto.codecs.lowrank import layer_matrix

    report_path = tmp_path / "report.json"
    digits = not (FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file()
    proc = procs.hogshard(
        "launch-powersgd", "launch", "--servers", "1", "--workers", "3", "--policy", "async",
        "--codec", "powersgd:2", "--no-progress", "--", PYTHON, EXAMPLE, *TRAIN_FLAGS,
        "--epochs", "4" if digits else "1", "--report", str(report_path))
    code = proc.wait(120.0)
    assert code == 0, f"hogshard launch exited with {code}\n{proc.tail(80)}"
    report = json.loads(report_path.read_text())
    side = 8 if digits else 28  # examples/fashion_mnist.py's SmallCNN on this data set
    shapes = [(16, 1, 3, 3), (16,), (32, 16, 3, 3), (32,), (64, 32 * (side // 4) ** 2), (64,),
              (10, 64), (10,)]
    assert report["parameters"] == sum(int(np.prod(s)) for s in shapes)
    expected = PowerSGDCodec(2).nbytes_for_layers([layer_matrix(s) for s in shapes])
    assert report["bytes_pushed_per_step"] == expected, (report["bytes_pushed_per_step"], expected)
    threshold = MIN_ACCURACY["powersgd:2"][report["dataset"]]
    assert report["test_accuracy"] >= threshold, (
        f"powersgd:2: {report['dataset']} accuracy {report['test_accuracy']:.4f} < {threshold}")


# ---------------------------------------------------------------------------------------------
# `--codec dgc` picks its own server rule; a pairing known to fail is refused
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(240, method="signal")
def test_dgc_trains_with_its_recipe_and_refuses_a_server_momentum(procs, tmp_path: Path) -> None:
    """Without --rule/--lr the example takes DGC's recipe (plain sgd on the servers, lr 0.05);
    the warm-up, 4 % of the run's steps (taken from the shard's length, not the fixed 20 of an
    unknown run), sends 25 %, then 6.25 % ... of the gradient, then 0.5 % in the compact
    layout. With --rule momentum every worker stops with DGC's ConfigError before training."""
    from hogshard.datasets import FASHION_MNIST
    from hogshard.proto.codecs import make_codec

    digits = not (FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file()
    report_path = tmp_path / "report.json"
    flags = ["--batch", "32", "--limit", "6000", "--epochs", "4" if digits else "1",
             "--report", str(report_path)]
    proc = procs.hogshard("launch-dgc", "launch", "--servers", "2", "--workers", "3",
                          "--policy", "async", "--codec", "dgc", "--no-progress", "--",
                          PYTHON, EXAMPLE, *flags)
    code = proc.wait(150.0)
    assert code == 0, f"hogshard launch exited with {code}\n{proc.tail(80)}"
    report = json.loads(report_path.read_text())
    assert (report["rule"], report["lr"]) == ("sgd", 0.05), report
    assert report["codec"] == "topk:0.005:compact,momentum=0.9,clip=2.0,warmup=4%", report
    rule, steps, size = TableRule.parse(report["codec"]), report["steps"], report["parameters"]
    assert rule.warmup_steps(steps) < rule.warmup_steps(None)  # derived from the run
    expected = sum(make_codec(rule.codec_at(step, steps)).nbytes_for(size)
                   for step in range(steps)) / steps
    # two chunks: each rounds its k up and adds its scale
    assert report["bytes_pushed_per_step"] == pytest.approx(expected, rel=0.02), (report, expected)
    assert report["bytes_pushed_per_step"] < 4 * size / 50
    # 63 steps a worker learn slowly (chance is 0.1)
    assert report["test_accuracy"] >= 0.3, report

    refused = procs.hogshard("launch-dgc-momentum", "launch", "--servers", "1", "--workers", "1",
                             "--policy", "async", "--codec", "dgc", "--no-progress", "--",
                             PYTHON, EXAMPLE, *flags, "--rule", "momentum")
    assert refused.wait(90.0) != 0, refused.tail(40)
    assert "plain 'sgd'" in refused.output(), refused.tail(40)


# ---------------------------------------------------------------------------------------------
# corrupt compressed pushes
# ---------------------------------------------------------------------------------------------

TABLE, SIZE, CHUNK, LR = "model", 400, 100, 0.5


def raw_push(ctx: zmq.Context, address: str, request_id: int, chunk: int, codecs: Any,
             arrays: list[np.ndarray]) -> tuple[dict[str, Any], int]:
    """A push built by hand from a fresh DEALER; returns the reply header and frame count."""
    fields = {"v": 1, "op": "push", "id": request_id, "from": "evil-test", "table": TABLE,
              "chunks": [chunk], "versions": [0], "codecs": codecs,
              "arrays": [{"dtype": a.dtype.str, "shape": list(a.shape)} for a in arrays]}
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart([msgpack.packb(fields, use_bin_type=True),
                             *(a.tobytes() for a in arrays)])
        if not sock.poll(int(REPLY_TIMEOUT_S * 1000), zmq.POLLIN):
            raise AssertionError(f"no reply from {address} within {REPLY_TIMEOUT_S} s")
        reply = sock.recv_multipart()
        return msgpack.unpackb(reply[0], raw=False), len(reply)
    finally:
        sock.close(0)


def corrupt_cases(n: int) -> list[tuple[str, Any, list[np.ndarray], tuple[str, ...]]]:
    """(name, codecs field, arrays, words the error message must contain) for a chunk of n."""
    k = n // 2
    values, indices = np.ones(k, "<f4"), np.arange(0, n, 2, dtype="<i4")
    past_end = indices.copy()
    past_end[-1] = n
    bits = np.zeros((n + 7) // 8, "|u1")
    return [
        ("unknown codec", [["bogus", {}, 1]], [np.ones(n, "<f4")], ("unknown codec", "bogus")),
        ("bad codec parameter", [["topk:0", {}, 1]], [np.ones(n, "<f4")], ("(0, 1]",)),
        ("too few frames for topk", [["topk:0.5", {"n": n, "k": k}, 1]], [values],
         ("expected 2 array frame",)),
        ("more frames claimed than sent", [["none", {}, 2]], [np.ones(n, "<f4")],
         ("claims 2 frames",)),
        ("frames left over", [["topk:0.5", {"n": n, "k": k}, 2]], [values, indices, values],
         ("2 frames", "3 came")),
        ("topk index out of range", [["topk:0.5", {"n": n, "k": k}, 2]], [values, past_end],
         ("strictly increasing", f"[0, {n})")),
        ("topk wrong k", [["topk:0.5", {"n": n, "k": k - 1}, 2]], [values[1:], indices[1:]],
         ("'k'", str(k))),
        ("sign NaN scale", [["sign", {}, 2]], [bits, np.array([np.nan], "<f4")],
         ("scale", "finite")),
        ("sign block NaN scale", [["sign:50", {}, 2]], [bits, np.array([1.0, np.nan], "<f4")],
         ("scale", "finite")),
        ("qsgd infinite norm", [["qsgd:16", {}, 2]], [np.zeros(n, "|u1"),
                                                      np.array([np.inf], "<f4")], ("norm",)),
        ("compact topk zero gap", [["topk:0.5:compact", {"n": n, "k": k, "m": k}, 3]],
         [np.ones(1, "<f4"), values.astype("<f2"), np.zeros(k, "<u2")], ("gaps",)),
        ("compact topk past the end", [["topk:0.5:compact", {"n": n, "k": k, "m": k}, 3]],
         [np.ones(1, "<f4"), values.astype("<f2"), np.full(k, 3, "<u2")],
         ("strictly increasing", f"[0, {n})")),
        ("codecs not a list", "topk:0.5", [np.ones(n, "<f4")], ("codecs",)),
        ("entry not a triple", [["none", {}]], [np.ones(n, "<f4")], ("[spec, meta",)),
    ]


@pytest.mark.integration
@pytest.mark.timeout(60, method="signal")
def test_corrupt_compressed_pushes_get_errors_and_change_nothing(cluster_factory,
                                                                  zmq_ctx) -> None:
    cluster = cluster_factory(servers=2, policy="async")
    settings = ClientSettings(scheduler=cluster.address, connect_timeout=30.0,
                              request_timeout=30.0)
    client = PSClient(settings, zmq_ctx)
    try:
        expected = np.arange(SIZE, dtype=np.float32) * np.float32(0.25)
        table = client.dense_table(TABLE, SIZE, {"rule": "sgd", "lr": LR},
                                   init=expected.copy(), chunk_elems=CHUNK)
        grad = np.ones(SIZE, np.float32)
        out = np.empty(SIZE, np.float32)

        def step(when: str) -> None:
            """A good uncompressed push; the pull must show exactly its update."""
            client.push(table, grad).result(30.0)
            expected[...] -= np.float32(LR) * grad
            client.pull(table, out).result(30.0)
            assert np.array_equal(out, expected), f"weights changed by a bad push ({when})"

        address, chunk = cluster.server_address(0), table.by_server[0][0]
        step("before")
        failures = []
        for number, (name, codecs, arrays, words) in enumerate(corrupt_cases(chunk.length), 300):
            reply, frames = raw_push(zmq_ctx, address, number, chunk.chunk_id, codecs, arrays)
            message = str(reply.get("message", ""))
            problems = [f"message lacks {w!r}" for w in words if w.lower() not in message.lower()]
            if reply.get("op") != "error" or reply.get("id") != number or frames != 1:
                problems.insert(0, "expected a one-frame error reply echoing the id")
            if problems:
                failures.append(f"{name}: {'; '.join(problems)}; got {reply}")
            step(f"after {name!r}")
        assert not failures, "\n".join(failures)
        assert all(p.alive() for p in [cluster.scheduler, *cluster.servers]), \
            cluster.procs.report()
        # A good compact top-k push applies exactly the entries it kept: magnitudes j / 128
        # (j = 29..128 in each chunk) are exact in half precision under the scale 2^-15.
        compressor = Compressor(CompressionPolicy.parse("topk:0.5:compact,min_size=1"))
        j = np.arange(SIZE) % CHUNK + 29
        sparse_grad = (j * np.where(j % 2 == 0, 1.0, -1.0) / 128.0).astype(np.float32)
        client.push(table, sparse_grad, compressor=compressor).result(30.0)
        expected[...] -= np.float32(LR) * np.where(j > CHUNK + 28 - CHUNK // 2, sparse_grad, 0)
        client.pull(table, out).result(30.0)
        assert np.array_equal(out, expected), "a compact top-k push applied other values"
    finally:
        client.close()


# ---------------------------------------------------------------------------------------------
# bad --codec flags
# ---------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(90, method="signal")
def test_bad_codec_flags_are_refused_at_start_up(procs, tmp_path: Path) -> None:
    marker = tmp_path / "worker-ran"
    command = ["--", PYTHON, "-c", f"open({str(marker)!r}, 'w')"]
    cases = [
        ("launch", "topk:0", ("topk", "(0, 1]")),
        ("launch", "topk:1.5", ("1.5", "(0, 1]")),
        ("launch", "bogus", ("unknown codec", "'bogus'", "topk:RATIO")),
        ("worker", "powersgd:0", ("rank", "[1, 65535]")),
        ("worker", "sign:0", ("block",)),
    ]
    for verb, codec, words in cases:
        extra = ["--scheduler", "tcp://127.0.0.1:9"] if verb == "worker" else []
        code, output = procs.run(f"{verb}-{codec}", [PYTHON, "-m", "hogshard", verb, *extra,
                                                     "--codec", codec, *command], CLI_TIMEOUT_S)
        assert code == 2, f"--codec {codec}: expected click's usage error (2), got {code}\n{output}"
        assert "Traceback" not in output and "--codec" in output, output
        for word in words:
            assert word in output, f"--codec {codec}: {word!r} not in the message:\n{output}"
    assert not marker.exists(), "a worker command ran despite a bad --codec"
