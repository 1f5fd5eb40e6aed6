"""What a server tells the scheduler about the dense tables it holds, so that a restarted
scheduler can relearn the shard map from the servers' registrations (PROTOCOL.md section 10),
and the table sizes a server learns from the map for that report.

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

from hogshard.ps.dense import DenseStore


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
