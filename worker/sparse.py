"""The client side of embedding tables (numpy only): declare, pull rows, push row gradients.

Rows are routed by id: shard ``splitmix64(id) % S`` (:func:`hogshard.proto.hashing.shard_of`)
over the job's servers sorted by rank, as they were when the client joined (the routing never
changes while it runs), so every worker (and any other language's client) agrees without asking
the scheduler. Embedding rows are not replicated: a server lost is its rows lost. One request per server carries every table of a step.

Example::

    user = client.embedding_table("user", dim=16, rule={"rule": "rowwise_adagrad", "lr": 0.05})
    ids = np.unique(batch_ids)                        # int64
    rows = np.empty((ids.size, 16), np.float32)
    client.pull_rows([user], [ids], [rows]).result()
    client.push_rows([user], [ids], [row_grads], clock=step).result()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hogshard.proto.errors import ConfigError
from hogshard.proto.hashing import shard_of
from hogshard.ps.embedding import EmbeddingSpec
from hogshard.ps.row_rules import make_row_rule
from hogshard.worker.futures import Future

if TYPE_CHECKING:
    from hogshard.worker.client import PSClient

INT64, FLOAT32 = np.dtype("<i8"), np.dtype("<f4")
DEFAULT_ROW_RULE = {"rule": "rowwise_adagrad", "lr": 0.01}


@dataclass(frozen=True)
class EmbeddingHandle:
    """A worker's handle on an embedding table: its spec (dim, id range, rule, init)."""

    spec: EmbeddingSpec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def dim(self) -> int:
        return self.spec.dim


def create_table(client: PSClient, spec: EmbeddingSpec) -> EmbeddingHandle:
    """Create the table on every server (idempotent: every worker may call it with the same
    spec; a different spec is refused with CONFLICT)."""
    make_row_rule(spec.rule)  # refuse a bad rule here, before anything is sent
    fields = spec.to_wire()
    futures = [client._request(rank, "emb_create", fields) for rank in client.embedding_ranks]
    Future.gather(futures, client._pump).result(client.settings.request_timeout)
    return EmbeddingHandle(spec)


def _split(client: PSClient, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(server rank, positions into ``ids``) for every server, by the stable hash."""
    ranks = client.embedding_ranks
    shard = shard_of(ids, len(ranks))
    order = np.argsort(shard, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(shard, minlength=len(ranks)))])
    return [(rank, order[bounds[i]:bounds[i + 1]]) for i, rank in enumerate(ranks)]


def _check_ids(handle: EmbeddingHandle, ids: np.ndarray) -> np.ndarray:
    if not isinstance(ids, np.ndarray) or ids.dtype != INT64 or ids.ndim != 1:
        raise ConfigError(f"table {handle.name!r}: ids must be a 1-D int64 numpy array")
    return np.ascontiguousarray(ids)


def _plan(
    client: PSClient,
    tables: Sequence[EmbeddingHandle],
    ids: Sequence[np.ndarray],
    arrays: Sequence[np.ndarray],
    op: str,
    what: str,
    noun: str,
) -> list[tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]]:
    """Per table: its checked ids, the (len x dim) float32 array that goes with them, and the
    positions of the ids each server owns."""
    if not (len(tables) == len(ids) == len(arrays)):
        raise ConfigError(f"{op} needs one id array and one {noun} per table")
    plans = []
    for handle, table_ids, array in zip(tables, ids, arrays, strict=True):
        table_ids = _check_ids(handle, table_ids)
        if array.dtype != FLOAT32 or array.shape != (table_ids.size, handle.dim):
            raise ConfigError(f"table {handle.name!r}: {what} must be float32 of shape "
                              f"({table_ids.size}, {handle.dim})")
        plans.append((table_ids, array, dict(_split(client, table_ids))))
    return plans


def _fields(tables: Sequence[EmbeddingHandle], clock: int | None) -> dict[str, Any]:
    fields: dict[str, Any] = {"tables": [h.name for h in tables]}
    if clock is not None:
        fields["clock"] = clock
    return fields


def pull_rows(
    client: PSClient,
    tables: Sequence[EmbeddingHandle],
    ids: Sequence[np.ndarray],
    outs: Sequence[np.ndarray],
    clock: int | None = None,
) -> Future:
    """Fetch the rows of ``ids[t]`` of every table into ``outs[t]`` (float32, len x dim),
    written when the future completes. One request per server for all the tables."""
    plans = _plan(client, tables, ids, outs, "pull_rows", "out", "output")
    futures = []
    for rank in client.embedding_ranks:
        fields = _fields(tables, clock)
        arrays = [table_ids[split[rank]] for table_ids, _, split in plans]

        def land(message: Any, rank: int = rank) -> None:
            for (_, out, split), rows in zip(plans, message.arrays, strict=True):
                out[split[rank]] = rows

        futures.append(client._request(rank, "emb_pull", fields, arrays, on_reply=land))
    return Future.gather(futures, client._pump)


def push_rows(
    client: PSClient,
    tables: Sequence[EmbeddingHandle],
    ids: Sequence[np.ndarray],
    grads: Sequence[np.ndarray],
    clock: int | None = None,
) -> Future:
    """Send the row gradients ``grads[t]`` (float32, len x dim) of ``ids[t]`` for every table.
    Sum duplicate ids first (the server sums them too, but that costs a sort there)."""
    plans = _plan(client, tables, ids, grads, "push_rows", "grads", "gradient array")
    futures = []
    for rank in client.embedding_ranks:
        fields = _fields(tables, clock)
        arrays = []
        for table_ids, table_grads, split in plans:
            arrays += [table_ids[split[rank]], table_grads[split[rank]]]
        client.bytes_pushed += sum(a.nbytes for a in arrays)
        futures.append(client._request(rank, "emb_push", fields, arrays))
    return Future.gather(futures, client._pump)


def embedding_stats(client: PSClient) -> dict[int, dict[str, Any]]:
    """Each server's ``emb_stats`` reply, by server rank."""
    ranks = client.embedding_ranks
    futures = [client._request(rank, "emb_stats", {}) for rank in ranks]
    replies = Future.gather(futures, client._pump).result(client.settings.request_timeout)
    return {rank: dict(reply.header) for rank, reply in zip(ranks, replies, strict=True)}
