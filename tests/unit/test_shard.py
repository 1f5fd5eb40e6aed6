"""The data helper (worker/shard.py): disjoint shares that cover the data set, one shuffle per
epoch on every rank, an empty share on a surplus rank, a resumed sequence, the progress total."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from hogshard.proto.errors import ConfigError
from hogshard.worker.shard import Shard, ShardSampler


def _samples(shard: Shard) -> list[int]:
    """The sample ids a shard of ``np.arange`` yields, in order."""
    return [int(v) for batch in shard for v in batch]


@pytest.mark.parametrize(("n", "workers"), [(10, 2), (101, 4), (7, 3), (3, 5)])
def test_one_epochs_shares_are_disjoint_and_cover_the_data(n: int, workers: int) -> None:
    data = np.arange(n)
    shares = [_samples(Shard(data, batch_size=4, rank=r, num_workers=workers, seed=3))
              for r in range(workers)]
    flat = [i for share in shares for i in share]
    assert sorted(flat) == list(range(n))  # every sample once: disjoint and covering
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_every_rank_draws_the_same_shuffle_and_a_new_one_each_epoch() -> None:
    n, workers, epochs = 50, 3, 3
    shards = [Shard(np.arange(n), batch_size=5, epochs=epochs, rank=r, num_workers=workers,
                    seed=7) for r in range(workers)]
    for epoch in range(epochs):
        # the ranks' shares interleave back into one permutation: all ranks drew the same one
        order = np.empty(n, dtype=np.int64)
        for r, shard in enumerate(shards):
            order[r::workers] = shard.indices(epoch)
        assert sorted(order.tolist()) == list(range(n))
        np.testing.assert_array_equal(order, np.random.default_rng([7, epoch]).permutation(n))
    assert not np.array_equal(shards[0].indices(0), shards[0].indices(1))
    other_seed = Shard(np.arange(n), batch_size=5, rank=0, num_workers=workers, seed=8)
    assert not np.array_equal(other_seed.indices(0), shards[0].indices(0))
    # the batches follow the epochs' orders, epoch after epoch
    assert _samples(shards[1]) == [i for e in range(epochs) for i in shards[1].indices(e)]


def test_a_surplus_rank_gets_an_empty_share_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hogshard.worker.shard"):
        shard = Shard(np.arange(20), batch_size=4, epochs=2, rank=2, num_workers=2)
    assert shard.surplus and len(shard) == 0 and shard.steps_per_epoch == 0
    assert list(shard) == []
    assert "surplus" in caplog.text and "empty" in caplog.text


def test_a_resumed_shard_yields_the_rest_of_the_same_sequence() -> None:
    def shard(start: int = 0) -> Shard:
        return Shard(np.arange(23), batch_size=4, epochs=3, rank=1, num_workers=2, seed=5,
                     start_step=start)

    full = [b.tolist() for b in shard()]
    assert len(full) == len(shard()) == 3 * 3  # 11 samples a epoch: batches of 4, 4, 3
    for start in (0, 1, 3, 4, 8, 9):
        assert [b.tolist() for b in shard(start)] == full[start:], start
    resumed = shard(4)
    assert resumed.position(4) == (1, 1)
    seen = [(resumed.epoch, resumed.step) for _ in resumed]
    assert seen[0] == (1, 4) and seen[-1] == (2, 8)
    with pytest.raises(ConfigError):
        shard(10)


def test_drop_last_and_arrays_tensors_and_datasets() -> None:
    x = np.arange(30, dtype=np.float32).reshape(10, 3)
    y = np.arange(10)
    for data in ((x, y), (torch.from_numpy(x), torch.from_numpy(y)),
                 TensorDataset(torch.from_numpy(x), torch.from_numpy(y))):
        batches = list(Shard(data, batch_size=2, rank=0, num_workers=2, drop_last=True))
        assert len(batches) == 2  # 5 samples: two whole batches, the last one dropped
        for bx, by in batches:
            assert isinstance(bx, torch.Tensor) and bx.shape == (2, 3)
            assert torch.equal(bx[:, 0], by.float() * 3)  # rows stay with their labels

    class Pairs(Dataset):
        def __len__(self) -> int:
            return 9

        def __getitem__(self, i: int) -> Any:
            return torch.tensor([float(i)]), i

    batches = list(Shard(Pairs(), batch_size=4, rank=0, num_workers=1, shuffle=False))
    assert [b[1].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    with pytest.raises(ConfigError):
        Shard((x, y[:5]), rank=0, num_workers=1)
    with pytest.raises(ConfigError):
        Shard(object(), rank=0, num_workers=1)
    with pytest.raises(ConfigError):
        Shard(x)  # neither a client nor a rank


def test_a_client_gives_rank_workers_and_gets_the_progress_total() -> None:
    progress: dict[str, Any] = {}
    client = SimpleNamespace(rank=1, settings=SimpleNamespace(num_workers=3),
                             set_progress=lambda **f: progress.update(f))
    shard = Shard(np.arange(100), batch_size=8, epochs=2, client=client)  # type: ignore[arg-type]
    assert (shard.rank, shard.steps_per_epoch) == (1, 5)  # 33 samples: 4 of 8, 1 of 1
    assert progress == {"total": 10} and len(list(shard)) == 10


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_the_sampler_gives_what_distributed_sampler_gives(shuffle: bool, drop_last: bool) -> None:
    dataset = torch.utils.data.TensorDataset(torch.arange(11))
    client = SimpleNamespace(rank=0, settings=SimpleNamespace(num_workers=3))
    for rank in range(3):
        client.rank = rank
        ours = ShardSampler(dataset, client=client, shuffle=shuffle, seed=5,  # type: ignore[arg-type]
                            drop_last=drop_last)
        torchs = DistributedSampler(dataset, num_replicas=3, rank=rank, shuffle=shuffle,
                                    seed=5, drop_last=drop_last)
        assert isinstance(ours, DistributedSampler)
        assert len(ours) == len(torchs) == (3 if drop_last else 4)
        for epoch in (0, 1, 7):
            ours.set_epoch(epoch)
            torchs.set_epoch(epoch)
            assert list(ours) == list(torchs) == ours.indices(epoch)
        loader = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=ours)
        assert sum(len(b[0]) for b in loader) == len(ours)


def test_the_sampler_takes_rank_and_workers_from_the_client_or_torchs_names() -> None:
    client = SimpleNamespace(rank=1, settings=SimpleNamespace(num_workers=2))
    sampler = ShardSampler(list(range(10)), client, shuffle=False)  # type: ignore[arg-type]
    assert (sampler.rank, sampler.num_workers, list(sampler)) == (1, 2, [1, 3, 5, 7, 9])
    assert list(ShardSampler(10, num_replicas=5, rank=4, shuffle=False)) == [4, 9]
    assert list(ShardSampler(11, 2, 3, seed=2)) == list(
        DistributedSampler(range(11), num_replicas=3, rank=2, seed=2))  # the older call
    surplus = ShardSampler(11, client=SimpleNamespace(  # type: ignore[arg-type]
        rank=3, settings=SimpleNamespace(num_workers=3)))
    assert surplus.surplus and len(surplus) == 0 and list(surplus) == []
    with pytest.raises(ConfigError, match="needs a client"):
        ShardSampler(11)
    with pytest.raises(ConfigError, match="has no len"):
        ShardSampler(iter(range(3)), 0, 1)
