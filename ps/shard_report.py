"""What a server tells the scheduler: the fields of its ``register`` (with the dense tables it
holds, so that a restarted scheduler can relearn the shard map from the servers'
registrations: PROTOCOL.md section 10), the table sizes a server learns from the map for that
report, and the fields of its heartbeats (stats, map epoch, checkpoint written, slots and
chunks handed off).

Example::

    >>> import numpy as np
    >>> from hogshard.ps.dense import DenseStore
    >>> store = DenseStore()
    >>> store.init("m", {"rule": "sgd", "lr": 0.1}, [(0, 0, 4)], [np.zeros(4, np.float32)])
    >>> store.sizes["m"] = (4, 4)
    >>> table_report(store, roles={}, handed=set(), rank=0)["m"]["chunks"]
    [[0, 0, 4]]
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from hogshard.ps.chunk_moves import ChunkMoves
from hogshard.ps.dense import DenseStore
from hogshard.ps.embedding_store import EmbeddingStore
from hogshard.ps.replication import Replicator
from hogshard.ps.stats import ServerStats


def table_report(store: DenseStore, roles: Mapping[str, Mapping[int, tuple[int, int]]],
                 handed: Collection[tuple[str, int]], rank: int) -> dict[str, Any]:
    """The dense tables held here, for ``register``: each table's spec and the chunks this
    server owns (of a replicated table, those it is primary of; none it handed to another
    server, whose next owner reports them)."""
    report = {}
    for name, table in store.tables.items():
        if name not in store.sizes:
            continue  # initialised by a client that did not send the size
        size, chunk_elems = store.sizes[name]
        table_roles = roles.get(name)
        report[name] = {
            "table": {"name": name, "size": size, "chunk_elems": chunk_elems,
                      "rule": table.rule_spec},
            "chunks": [[c.chunk_id, c.offset, c.weights.size]
                       for c in table.chunks.values()
                       if (table_roles is None or table_roles.get(c.chunk_id, (-1,))[0] == rank)
                       and (name, c.chunk_id) not in handed],
        }
    return report


def learn_sizes(store: DenseStore, assignments: Any) -> None:
    """Record the size and chunk size of each dense table the shard map assigns here (the
    spec in the assignments), so that a server that got its chunks by snapshot (a replacement,
    never sent ``init``) reports them to a restarted scheduler (:func:`table_report`).
    Malformed entries are skipped; a size already known is kept."""
    if not isinstance(assignments, dict):
        return
    for name, view in assignments.items():
        spec = view.get("table") if isinstance(view, dict) else None
        if not isinstance(spec, dict):
            continue
        size, chunk_elems = spec.get("size"), spec.get("chunk_elems")
        if type(size) is int and type(chunk_elems) is int and size > 0 and chunk_elems > 0:
            store.sizes.setdefault(name, (size, chunk_elems))


def register_fields(address: str, host: str, incarnation: int, rank_hint: int | None,
                    tables: dict[str, Any], slots: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """A server's ``register`` request: ``tables`` (:func:`table_report`; a restarted
    scheduler relearns the shard map from them) and ``slots`` (where the embedding slots are)
    only when there are some.

    >>> register_fields("tcp://h:1", "h", 7, None, {})["role"]
    'server'
    """
    fields: dict[str, Any] = {"role": "server", "address": address, "rank_hint": rank_hint,
                              "incarnation": incarnation, "host": host}
    if tables:
        fields["tables"] = tables
    if slots is not None:
        fields["embedding_slots"] = slots
    return fields


def heartbeat_fields(stats: ServerStats, embeddings: EmbeddingStore, replicas: Replicator,
                     chunk_moves: ChunkMoves, checkpoint: dict[str, Any] | None,
                     incarnation: int, workers_epoch: int | None) -> dict[str, Any]:
    """A server's heartbeat: its stats (with the embedding tables' summary and the chunks
    moved), the map epoch it knows, the worker list it applied last, the checkpoint it wrote
    last, and the embedding slots and dense chunks it has handed off."""
    moved = chunk_moves.moved
    fields: dict[str, Any] = {"stats": {**stats.to_wire(), "embeddings": embeddings.summary(),
                                        **({"chunks_moved": dict(moved)}
                                           if any(moved.values()) else {})},
                              "map_epoch": replicas.map_epoch, "incarnation": incarnation}
    if workers_epoch is not None:
        fields["workers_epoch"] = workers_epoch
    if checkpoint is not None:
        fields["checkpoint"] = checkpoint
    handed_off = replicas.slots.ready(replicas.links)
    if handed_off:
        fields["handed_off"] = handed_off
    handed_chunks = chunk_moves.report()
    if handed_chunks:
        fields["handed_chunks"] = handed_chunks
    return fields
