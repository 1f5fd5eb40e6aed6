"""``Shard``: this rank's share of a data set, in batches, reshuffled every epoch.

Every rank draws the same permutation of the whole data set for an epoch (from the ``seed``
all ranks share and the epoch number) and takes every ``num_workers``-th index of it, starting
at its rank: the shares of one epoch are disjoint and together cover the data set (they differ
in size by one sample at most). A rank at or beyond ``num_workers`` (``client.surplus``: every
share is taken) gets an empty share and says so in the log, so a script needs no special case.

A shard yields ``len(shard)`` batches: ``steps_per_epoch`` for each of ``epochs`` epochs. Built
from a client (``client.shard(...)``) it sets the progress ``total`` that ``hogshard launch``
shows (``PSOptimizer.step`` reports ``done``). ``start_step`` resumes a job: the shard skips
the first ``start_step`` batches of this rank's sequence, e.g. ``start_step=opt.steps`` after
``opt.load_state_dict(...)`` (one step per batch); step ``k`` is batch ``k % steps_per_epoch``
of epoch ``k // steps_per_epoch`` (:meth:`Shard.position`).

For a script with its own ``DataLoader`` and epoch loop, :class:`ShardSampler` is torch's
``DistributedSampler`` with the rank and the number of workers taken from the client (its
order and padding, not the share above).

Example (two ranks' shares of ten samples, one epoch)::

    >>> import numpy as np
    >>> xs = np.arange(10, dtype=np.float32)
    >>> a = Shard(xs, batch_size=4, rank=0, num_workers=2, seed=1)
    >>> b = Shard(xs, batch_size=4, rank=1, num_workers=2, seed=1)
    >>> len(a), a.steps_per_epoch
    (2, 2)
    >>> sorted(np.concatenate([a.indices(0), b.indices(0)]).tolist()) == list(range(10))
    True
    >>> [tuple(x.shape) for x in a]
    [(4,), (1,)]
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate
from torch.utils.data.distributed import DistributedSampler

from hogshard.proto.errors import ConfigError

if TYPE_CHECKING:
    from hogshard.worker.client import PSClient

log = logging.getLogger(__name__)


def epoch_permutation(n: int, epoch: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """The order of all ``n`` samples in ``epoch``: the same on every rank for one ``seed``.

    >>> epoch_permutation(5, 0, 0, shuffle=False).tolist()
    [0, 1, 2, 3, 4]
    """
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


class ShardSampler(DistributedSampler):
    """``torch.utils.data.distributed.DistributedSampler`` with the rank and the number of
    workers taken from a :class:`PSClient`: this rank's indices of ``dataset`` for one epoch
    (``set_epoch`` before each), exactly those ``DistributedSampler`` gives the same rank
    (the same ``seed + epoch`` shuffle; without ``drop_last`` the order is padded with its
    first indices to a multiple of the workers, so every rank takes ``len(sampler)`` samples;
    with it, the tail that does not divide evenly is dropped). It is a ``DistributedSampler``
    (``isinstance`` holds). On a surplus rank (``client.surplus``) it is empty.

    ``dataset`` is anything with ``len()`` (an int stands for that many samples);
    ``num_replicas`` and ``rank`` (torch's names) override the client's. The older call
    ``ShardSampler(size, rank, num_workers, seed=0, shuffle=True)`` still works, with these
    semantics.

    Example::

        sampler = ShardSampler(dataset, client=client, shuffle=True, seed=0)
        loader = torch.utils.data.DataLoader(dataset, batch_size=64, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader: ...

    >>> [list(ShardSampler(5, r, 2, shuffle=False)) for r in (0, 1)]
    [[0, 2, 4], [1, 3, 0]]
    """

    def __init__(self, dataset: Any, client: PSClient | int | None = None,
                 num_workers: int | None = None, seed: int = 0, shuffle: bool = True, *,
                 num_replicas: int | None = None, rank: int | None = None,
                 drop_last: bool = False) -> None:
        if isinstance(client, int):  # ShardSampler(size, rank, num_workers, ...)
            client, rank = None, client if rank is None else rank
        num_replicas = num_workers if num_replicas is None else num_replicas
        if client is not None:
            rank = client.rank if rank is None else rank
            num_replicas = client.settings.num_workers if num_replicas is None else num_replicas
        if rank is None or num_replicas is None:
            raise ConfigError("ShardSampler needs a client, or both rank and num_replicas")
        if num_replicas < 1 or rank < 0:
            raise ConfigError(f"rank {rank} of {num_replicas} workers: expected rank >= 0 and "
                              "num_replicas >= 1")
        if isinstance(dataset, int):
            dataset = range(dataset)
        if not hasattr(dataset, "__len__"):
            raise ConfigError(f"ShardSampler: {type(dataset).__name__} has no len(); expected "
                              "a map-style Dataset or a number of samples")
        surplus = rank >= num_replicas
        super().__init__(dataset, num_replicas=num_replicas, rank=0 if surplus else rank,
                         shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.rank = rank
        if surplus:
            self.num_samples = 0

    @property
    def num_workers(self) -> int:
        """The job's workers (torch's ``num_replicas``)."""
        return int(self.num_replicas)

    @property
    def surplus(self) -> bool:
        """Whether this rank is beyond the job's workers (its share is empty)."""
        return self.rank >= self.num_replicas

    def indices(self, epoch: int) -> list[int]:
        """This rank's indices of ``epoch``, in the order they are visited."""
        current, self.epoch = self.epoch, epoch
        try:
            return list(iter(self))
        finally:
            self.epoch = current

    def __iter__(self) -> Iterator[int]:
        return iter([]) if self.surplus else super().__iter__()


class _Share:
    """The share ``Shard`` takes each epoch: every ``num_workers``-th index of one permutation
    of all the samples, from this rank on (no padding, no repeated samples)."""

    def __init__(self, size: int, rank: int, num_workers: int, seed: int = 0,
                 shuffle: bool = True) -> None:
        if num_workers < 1 or rank < 0:
            raise ConfigError(f"rank {rank} of {num_workers} workers: expected rank >= 0 and "
                              "num_workers >= 1")
        self.size, self.rank, self.num_workers = int(size), rank, num_workers
        self.seed, self.shuffle = seed, shuffle

    @property
    def surplus(self) -> bool:
        return self.rank >= self.num_workers

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's share of ``epoch``, in the order it is visited."""
        if self.surplus:
            return np.arange(0)
        order = epoch_permutation(self.size, epoch, self.seed, self.shuffle)
        return order[self.rank::self.num_workers]

    def __len__(self) -> int:
        return 0 if self.surplus else len(range(self.rank, self.size, self.num_workers))


class Shard:
    """This rank's batches of ``data`` over ``epochs`` epochs (see the module's docstring).

    ``data``: a map-style ``torch.utils.data.Dataset`` (batches collated as a ``DataLoader``
    does), an array or tensor (a batch is one tensor), or a tuple of arrays or tensors of the
    same length, e.g. ``(images, labels)`` (a batch is a tuple of tensors). numpy arrays become
    tensors without a copy before the batch is taken; ``device`` moves each batch there.
    ``drop_last`` drops each epoch's last, short batch. ``rank`` and ``num_workers`` come from
    ``client`` when one is given (``client.shard(...)`` passes it), which also gets the
    progress ``total``.

    Example::

        shard = client.shard((train_x, train_y), batch_size=64, epochs=2, seed=0,
                             start_step=opt.steps)
        for x, y in shard:        # shard.epoch is the epoch of the batch in hand
            ...
    """

    def __init__(self, data: Any, batch_size: int = 64, epochs: int = 1, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False, start_step: int = 0,
                 device: torch.device | str | None = None, *, rank: int | None = None,
                 num_workers: int | None = None, client: PSClient | None = None) -> None:
        if client is not None:
            rank = client.rank if rank is None else rank
            num_workers = client.settings.num_workers if num_workers is None else num_workers
        if rank is None or num_workers is None:
            raise ConfigError("Shard needs a client, or both rank and num_workers")
        if batch_size < 1 or epochs < 0 or start_step < 0:
            raise ConfigError(f"Shard: batch_size {batch_size}, epochs {epochs}, start_step "
                              f"{start_step}; expected batch_size >= 1, epochs >= 0 and "
                              "start_step >= 0")
        self._take, size = _indexer(data)
        self.sampler = _Share(size, rank, num_workers, seed, shuffle)
        self.batch_size, self.epochs, self.drop_last = batch_size, epochs, drop_last
        self.device = None if device is None else torch.device(device)
        self.start_step = start_step
        #: The epoch and the step (batches yielded since step 0) of the batch last yielded.
        self.epoch, self.step = start_step // max(1, self.steps_per_epoch), start_step
        if self.surplus:
            log.info("rank %d is beyond the job's %d workers (surplus): its share of the data "
                     "is empty, it trains nothing", rank, num_workers)
        elif start_step > len(self):
            raise ConfigError(f"Shard: start_step {start_step} is beyond the {len(self)} steps "
                              f"of {epochs} epochs")
        elif start_step:
            epoch, offset = self.position(start_step)
            log.info("rank %d resumes its data at step %d: epoch %d, batch %d of %d", rank,
                     start_step, epoch, offset, self.steps_per_epoch)
        if client is not None:
            client.set_progress(total=len(self))

    @property
    def rank(self) -> int:
        return self.sampler.rank

    @property
    def surplus(self) -> bool:
        """Whether this rank is beyond the job's workers: an empty share."""
        return self.sampler.surplus

    @property
    def steps_per_epoch(self) -> int:
        """Batches this rank takes in one epoch."""
        share = len(self.sampler)
        return share // self.batch_size if self.drop_last else -(-share // self.batch_size)

    def __len__(self) -> int:
        """Batches over all the epochs, from step 0 (those before ``start_step`` included)."""
        return self.epochs * self.steps_per_epoch

    def position(self, step: int) -> tuple[int, int]:
        """``(epoch, batch within the epoch)`` of step ``step`` of this rank's sequence."""
        per_epoch = max(1, self.steps_per_epoch)
        return step // per_epoch, step % per_epoch

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's sample indices of ``epoch``, in the order its batches take them."""
        return self.sampler.indices(epoch)

    def __iter__(self) -> Iterator[Any]:
        per_epoch = self.steps_per_epoch
        if per_epoch == 0:
            return
        first_epoch, offset = self.position(self.start_step)
        for epoch in range(first_epoch, self.epochs):
            order = self.indices(epoch)
            for batch in range(offset if epoch == first_epoch else 0, per_epoch):
                index = order[batch * self.batch_size:(batch + 1) * self.batch_size]
                self.epoch, self.step = epoch, epoch * per_epoch + batch
                yield self._to_device(self._take(index))

    def _to_device(self, batch: Any) -> Any:
        if self.device is None:
            return batch
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device)
        if isinstance(batch, (tuple, list)):
            return type(batch)(self._to_device(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self._to_device(v) for k, v in batch.items()}
        return batch


def _as_tensor(array: Any) -> torch.Tensor:
    return array if isinstance(array, torch.Tensor) else torch.from_numpy(np.asarray(array))


def _indexer(data: Any) -> tuple[Any, int]:
    """A function from an index array to a batch of ``data``, and ``data``'s length."""
    if isinstance(data, TensorDataset):
        data = tuple(data.tensors)
    if isinstance(data, (np.ndarray, torch.Tensor)):
        tensor = _as_tensor(data)
        return (lambda index: tensor[torch.from_numpy(index)]), len(tensor)
    if isinstance(data, tuple) and data and all(
            isinstance(a, (np.ndarray, torch.Tensor)) for a in data):
        tensors = [_as_tensor(a) for a in data]
        lengths = {len(t) for t in tensors}
        if len(lengths) != 1:
            raise ConfigError(f"Shard: the arrays have different lengths {sorted(lengths)}")
        return (lambda index: tuple(t[torch.from_numpy(index)] for t in tensors)), len(tensors[0])
    if isinstance(data, (Dataset, Sequence)) and hasattr(data, "__len__"):
        return (lambda index: default_collate([data[int(i)] for i in index])), len(data)
    raise ConfigError(f"Shard: {type(data).__name__} is not a map-style Dataset (with "
                      "__len__), an array, a tensor or a tuple of them")
