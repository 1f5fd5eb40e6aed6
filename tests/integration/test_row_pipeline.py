"""Pipelined embedding rows against a real scheduler and servers, one worker: the rows of the
next batch are pulled while this one computes and row pushes are not waited for. With
``pipeline="exact"`` every step sees the rows it sees without the pipeline (bit for bit, with
and without the hot-row cache); with ``"stale"`` a step sees the rows before the previous
step's push, exactly; ``"stale"`` is refused under ``ssp:0``; and a one-worker DLRM job
(shared hot-row cache on) predicts bit for bit the same with ``--pipeline exact`` as without."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hogshard.proto.config import ClientSettings
from hogshard.proto.errors import ConfigError
from hogshard.proto.hashing import init_rows
from hogshard.worker.client import PSClient
from hogshard.worker.embedding import RemoteEmbeddingBag, flush, push_gradients
from hogshard.worker.sparse import embedding_stats

DIM, LR, SCALE, SEED, STEPS = 4, 0.5, 0.1, 5, 12
pytestmark = pytest.mark.integration


def id_batches() -> list[torch.Tensor]:
    """Batches of 16 ids from 30, so consecutive batches share many ids (and repeat some)."""
    rng = np.random.default_rng(0)
    return [torch.from_numpy(rng.integers(0, 30, (16, 1))) for _ in range(STEPS)]


def train(client: PSClient, bag: RemoteEmbeddingBag, loss_of) -> tuple[list[np.ndarray],
                                                                       np.ndarray]:
    """One worker's steps on ``bag``: the rows each step saw, and the final rows of ids 0-29."""
    batches, seen = id_batches(), []
    for k, ids in enumerate(batches):
        pooled = bag(ids)  # sum over one id per sample: the rows themselves
        if bag.pipeline is not None and k + 1 < STEPS:
            bag.prefetch(batches[k + 1])
        seen.append(pooled.detach().numpy().copy())
        loss_of(pooled).backward()  # pushes the rows' gradients as it ends
        push_gradients(client, [bag])  # waits for that push (pipelined: not waited for)
        client.clock += 1
    flush(client, [bag])
    everything = np.arange(30, dtype=np.int64)
    final = np.empty((30, DIM), np.float32)
    client.pull_rows([bag.handle], [everything], [final]).result(30.0)
    return seen, final


def expected_rows(lag: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Under sgd on ``sum(rows)`` every occurrence of an id moves its row by -LR; a step sees
    the pushes of all steps but the last ``lag`` ones (float32, in the servers' order)."""
    rows = init_rows(SEED, "linear", np.arange(30, dtype=np.int64), DIM, SCALE)
    history = [rows.copy()]
    for ids in id_batches():
        counts = np.bincount(ids.numpy().reshape(-1), minlength=30).astype(np.float32)
        touched = counts > 0
        rows[touched] -= np.float32(LR) * counts[touched, None]
        history.append(rows.copy())
    seen = [history[max(0, k - lag)][ids.numpy().reshape(-1)]
            for k, ids in enumerate(id_batches())]
    return seen, history[-1]


@pytest.mark.timeout(90, method="signal")
@pytest.mark.parametrize("pipeline,lag", [(None, 0), ("exact", 0), ("stale", 1)])
def test_each_step_sees_the_rows_its_pipeline_promises(cluster_factory, pipeline: str | None,
                                                       lag: int) -> None:
    address = cluster_factory(servers=2, policy="async").address
    client = PSClient(ClientSettings(scheduler=address, request_timeout=30.0))
    try:
        bag = RemoteEmbeddingBag(client, "linear", 30, DIM, mode="sum", rule={"rule": "sgd", "lr": LR},
                                 seed=SEED, init_scale=SCALE, pipeline=pipeline)
        seen, final = train(client, bag, lambda pooled: pooled.sum())
        want_seen, want_final = expected_rows(lag)
        for k, (got, want) in enumerate(zip(seen, want_seen, strict=True)):
            np.testing.assert_array_equal(got, want, err_msg=f"step {k}")
        np.testing.assert_array_equal(final, want_final)  # every push applied, once
        # one row pull per server and step (each batch reaches both), and the final one: the
        # exact pipeline pulls behind the push instead of pulling again after it
        pulls = [s["tables"]["linear"]["pulls"] for s in embedding_stats(client).values()]
        assert pulls == [STEPS + 1] * 2, pulls
        # no replication and no slots: the client never asked for an embedding map
        assert client.status()["errors"] == {}
    finally:
        client.close()


@pytest.mark.timeout(90, method="signal")
@pytest.mark.parametrize("cache", [None, 2])
def test_exact_pipeline_trains_bit_for_bit_as_without_it(cluster_factory,
                                                         cache: int | None) -> None:
    address = cluster_factory(servers=2, policy="async").address
    client = PSClient(ClientSettings(scheduler=address, request_timeout=30.0))
    target = torch.linspace(-1.0, 1.0, DIM)

    def loss_of(pooled: torch.Tensor) -> torch.Tensor:  # gradients depend on the rows seen
        return ((pooled - target) ** 2).sum() / 2

    try:
        runs = []
        for name, pipeline in (("plain", None), ("piped", "exact")):
            # init_scale 0: both tables start from the same (zero) rows
            bag = RemoteEmbeddingBag(client, name, 30, DIM, mode="sum", rule={"rule": "sgd", "lr": 0.1},
                                     init_scale=0.0, cache_staleness=cache, pipeline=pipeline)
            runs.append((train(client, bag, loss_of), bag.cache.stats() if cache else None))
        (seen_a, final_a), stats_a = runs[0]
        (seen_b, final_b), stats_b = runs[1]
        for k, (a, b) in enumerate(zip(seen_a, seen_b, strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"step {k}")
        np.testing.assert_array_equal(final_a, final_b)
        assert not np.array_equal(seen_a[-1], seen_a[0])  # training moved the rows
        assert stats_a == stats_b  # the same hits and misses at the same clocks
        if cache:
            assert stats_a["hits"] > 0
    finally:
        client.close()


@pytest.mark.timeout(60, method="signal")
def test_stale_rows_are_refused_under_ssp0(cluster_factory) -> None:
    address = cluster_factory(servers=1, policy="ssp:0").address
    client = PSClient(ClientSettings(scheduler=address, request_timeout=30.0))
    try:
        with pytest.raises(ConfigError, match="ssp:0"):
            RemoteEmbeddingBag(client, "t", 30, DIM, pipeline="stale")
        bag = RemoteEmbeddingBag(client, "t", 30, DIM, mode="sum", pipeline="exact")  # exact is allowed
        ids = torch.tensor([[1], [2]])
        bag.prefetch(ids)
        assert bag(ids).shape == (2, DIM)
        plain = RemoteEmbeddingBag(client, "u", 30, DIM, mode="sum")
        with pytest.raises(ConfigError, match="pipeline"):
            plain.prefetch(ids)
    finally:
        client.close()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_one_worker_dlrm_predicts_the_same_with_the_exact_pipeline(procs, tmp_path: Path
                                                                   ) -> None:
    dlrm = str(Path(__file__).resolve().parents[2] / "examples" / "dlrm.py")
    reports = []
    for name, extra in (("plain", []), ("piped", ["--pipeline", "exact"])):
        argv = [sys.executable, "-m", "hogshard", "launch", "--servers", "2", "--workers", "1",
                "--no-progress", "--", sys.executable, dlrm, "--samples", "6000", "--vocab",
                "2000", "--no-baseline", "--cache-staleness", "4", *extra,
                "--predictions", str(tmp_path / f"{name}.npy"),
                "--report", str(tmp_path / f"{name}.json")]
        code, output = procs.run(f"dlrm-{name}", argv, timeout=90.0)
        assert code == 0, output[-3000:]
        reports.append(json.loads((tmp_path / f"{name}.json").read_text()))
    assert reports[1]["pipeline"] == "exact" and reports[0]["pipeline"] is None
    assert 0.3 < reports[0]["cache_hit_rate"] == reports[1]["cache_hit_rate"]
    plain, piped = np.load(tmp_path / "plain.npy"), np.load(tmp_path / "piped.npy")
    assert plain.size > 500
    np.testing.assert_array_equal(plain, piped)
