"""A remote table's rows in its module's ``state_dict()``: never dropped without a word.

``state_dict()`` holds a table's rows as ``<prefix>weight`` (float32, ``num_embeddings x
dim``, pulled from the servers once every push of this worker was applied) where the table has a
``num_embeddings`` of at most ``STATE_DICT_MAX_ELEMS / dim`` rows and no ``max_rows`` (pulling
every row would evict trained ones); otherwise it raises a ConfigError naming the two ways a
job's rows are saved: ``hogshard checkpoint`` (rows and row state, to resume) and ``hogshard
export`` (rows to serve).

``load_state_dict()`` writes a ``weight`` to the servers (``emb_assign``: every row but the
padding row; the rows' optimizer state is kept, as torch's ``load_state_dict`` leaves an
optimizer's alone) in a job that hashes rows over its servers; with ``--replication`` or
``--embedding-slots`` only a ``weight`` equal to the rows they hold loads, any other raises
the same ConfigError. A ``state_dict`` without ``weight`` is torch's missing key.

Example::

    torch.save(model.state_dict(), "model.pt")   # dense weights and every table that fits
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hogshard.proto.errors import ConfigError

if TYPE_CHECKING:
    from hogshard.worker.embedding import RemoteEmbeddingBag

log = logging.getLogger(__name__)

#: The most elements (rows x dim) of a table that ``state_dict()`` pulls (1 GiB of float32).
STATE_DICT_MAX_ELEMS = 1 << 28
#: The most elements one ``emb_assign`` request carries (16 MiB of float32).
ASSIGN_ELEMS = 1 << 22

SAVED_ELSEWHERE = ("a job's rows are saved by `hogshard checkpoint` (rows and their optimizer "
                   "state, to resume from) and served from `hogshard export` "
                   "(hogshard.worker.export.load_exported)")


def _refusal(bag: RemoteEmbeddingBag) -> str | None:
    """Why the table's rows cannot be held in a state dict (None: they can)."""
    spec = bag.handle.spec
    if bag.num_embeddings is None:
        return "its ids are unbounded (num_embeddings=None)"
    if bag.num_embeddings * bag.embedding_dim > STATE_DICT_MAX_ELEMS:
        return (f"its {bag.num_embeddings} x {bag.embedding_dim} rows exceed "
                f"STATE_DICT_MAX_ELEMS ({STATE_DICT_MAX_ELEMS})")
    if spec.max_rows is not None or spec.admit_after is not None:
        return "it bounds the rows servers hold (max_rows, admit_after): pulling all would " \
               "change them"
    return None


def pull_all_rows(bag: RemoteEmbeddingBag) -> np.ndarray:
    """Every row of the table, once this worker's pushes were applied."""
    from hogshard.worker.embedding import flush

    client = bag.client
    flush(client, [bag])
    assert bag.num_embeddings is not None
    ids = np.arange(bag.num_embeddings, dtype=np.int64)
    rows = np.empty((ids.size, bag.embedding_dim), np.float32)
    client.pull_rows([bag.handle], [ids], [rows]).result(client.settings.request_timeout)
    if bag.padding_idx is not None:
        rows[bag.padding_idx] = 0.0  # torch's padding row
    return rows


def assignable(bag: RemoteEmbeddingBag) -> bool:
    """Whether the table's rows can be written from here: it fits (as for ``state_dict()``)
    and the job hashes rows over its servers (no replication, no embedding slots)."""
    client = bag.client
    return _refusal(bag) is None and client.embedding_map is None and \
        not client.job_places_embeddings


def write_rows(bag: RemoteEmbeddingBag, rows: np.ndarray) -> None:
    """Set every row of the table (but the padding row) to ``rows`` (``num_embeddings x dim``
    float32), in requests of at most ``ASSIGN_ELEMS`` elements, once this worker's pushes were
    applied."""
    from hogshard.worker.embedding import flush
    from hogshard.worker.sparse import assign_rows

    client = bag.client
    flush(client, [bag])
    ids = np.arange(rows.shape[0], dtype=np.int64)
    if bag.padding_idx is not None:
        ids = ids[ids != bag.padding_idx]
    step = max(1, ASSIGN_ELEMS // bag.embedding_dim)
    for start in range(0, ids.size, step):
        part = ids[start:start + step]
        assign_rows(client, [bag.handle], [part], [np.ascontiguousarray(rows[part])]).result(
            client.settings.request_timeout)


def rows_held(bag: RemoteEmbeddingBag) -> int:
    """How many rows of the table the servers hold (0 for a table no request touched yet)."""
    from hogshard.worker.sparse import embedding_stats

    name = bag.handle.name
    return sum(int(reply.get("tables", {}).get(name, {}).get("rows", 0))
               for reply in embedding_stats(bag.client).values())


def upload_weight(bag: RemoteEmbeddingBag, weight: torch.Tensor) -> None:
    """A module's initial rows (``_weight``, a converted module's weight) written by the worker
    ranked 0 where the table is :func:`assignable` and holds no rows yet: a table restored
    from a checkpoint, or trained before this worker (re)started, keeps its rows. ConfigError
    where the table is not assignable, or the shape is not the table's."""
    shape = (bag.num_embeddings, bag.embedding_dim)
    if tuple(weight.shape) != shape:
        raise ConfigError(f"table {bag.handle.name!r}: initial rows of shape "
                          f"{tuple(weight.shape)}; the table is {shape}")
    if not assignable(bag):
        raise ConfigError(f"table {bag.handle.name!r}: initial rows cannot be written to it "
                          f"({_refusal(bag) or 'a job with --replication or --embedding-slots'}"
                          "); rows start from the table's init (seed=, init_scale=)")
    if bag.client.rank > 0:
        return
    held = rows_held(bag)
    if held:
        log.warning("table %r already holds %d rows (restored from a checkpoint, or trained "
                    "before this worker started): its initial rows are not written",
                    bag.handle.name, held)
        return
    write_rows(bag, weight.detach().to("cpu", torch.float32).numpy())


def save_rows(bag: RemoteEmbeddingBag) -> torch.Tensor:
    """The table's rows for ``state_dict()``; ConfigError where they cannot be held."""
    why = _refusal(bag)
    if why is not None:
        raise ConfigError(f"table {bag.handle.name!r}: state_dict() cannot hold its rows: {why}; "
                          f"{SAVED_ELSEWHERE}")
    return torch.from_numpy(pull_all_rows(bag))


def load_rows(bag: RemoteEmbeddingBag, state_dict: Any, prefix: str, local_metadata: Any,
              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
              error_msgs: list[str]) -> None:
    """``load_state_dict()``'s part for the rows: equal rows load, others raise."""
    key = prefix + "weight"
    if key in unexpected_keys:  # torch's part knows only parameters and buffers
        unexpected_keys.remove(key)
    if key not in state_dict:
        if strict:
            missing_keys.append(key)
        return
    given = state_dict[key]
    shape = (bag.num_embeddings, bag.embedding_dim)
    if tuple(given.shape) != shape:
        error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                          f"{tuple(given.shape)}, the remote table has {shape}")
        return
    rows = given.detach().to("cpu", torch.float32).numpy()
    if assignable(bag):
        write_rows(bag, rows)
        return
    if _refusal(bag) is None and np.array_equal(rows, pull_all_rows(bag)):
        return
    raise ConfigError(f"table {bag.handle.name!r}: load_state_dict() cannot write these rows "
                      "to the servers (a job with --replication or --embedding-slots takes "
                      f"only rows equal to theirs); {SAVED_ELSEWHERE}: resume with `hogshard "
                      "checkpoint` and `--restore DIR`")
