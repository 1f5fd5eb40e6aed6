"""All embedding tables of one server: requests validated whole, then served table by table
(the rows a pull creates in many tables are initialised in one pass).

Example::

    >>> import numpy as np
    >>> store = EmbeddingStore()
    >>> store.create(EmbeddingSpec("user", dim=4, num_embeddings=None,
    ...                            rule={"rule": "sgd", "lr": 1.0}))
    True
    >>> ids = np.array([10**15, 7], dtype=np.int64)
    >>> before = store.pull(["user"], [ids])[0]
    >>> store.push(["user"], [ids], [np.ones((2, 4), np.float32)])
    >>> after = store.pull(["user"], [ids])[0]
    >>> np.allclose(after, before - 1), store.table("user").rows
    (True, 2)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hogshard.proto.errors import ConflictError, HogshardError, ProtocolError, UnknownTableError
from hogshard.proto.hashing import init_rows_of_tables
from hogshard.proto.manifest import atomic_write
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.embedding import FLOAT32, EmbeddingTable, Found
from hogshard.ps.row_checks import check_grads, check_ids


def _initial_rows(tables: Sequence[EmbeddingTable], found: Sequence[Found | None]
                  ) -> list[np.ndarray | None]:
    """The initial rows of every table's missing ids, computed in one pass for the tables of
    one dim and scale (None where a table creates none)."""
    out: list[np.ndarray | None] = [None] * len(tables)
    groups: dict[tuple[int, float], list[tuple[int, EmbeddingTable, np.ndarray]]] = {}
    for i, (table, table_found) in enumerate(zip(tables, found, strict=True)):
        if table_found is not None and table_found[1].size:
            key = (table.spec.dim, table.spec.scale)
            groups.setdefault(key, []).append((i, table, table_found[1]))
    for (dim, scale), members in groups.items():
        parts = [(table.spec.seed, table.name, new_ids) for _, table, new_ids in members]
        for (i, _, _), rows in zip(members, init_rows_of_tables(parts, dim, scale), strict=True):
            out[i] = rows
    return out


class EmbeddingStore:
    """All embedding tables held by one server."""

    def __init__(self) -> None:
        self.tables: dict[str, EmbeddingTable] = {}

    def create(self, spec: EmbeddingSpec) -> bool:
        """Create a table; idempotent for an identical spec (returns False), CONFLICT else."""
        existing = self.tables.get(spec.name)
        if existing is not None:
            if existing.spec != spec:
                raise ConflictError(f"embedding table {spec.name!r} exists as "
                                    f"{existing.spec.to_wire()}; got {spec.to_wire()}")
            return False
        table = EmbeddingTable(spec)  # builds the rule: a bad rule raises before insertion
        self.tables[spec.name] = table
        return True

    def table(self, name: Any) -> EmbeddingTable:
        table = self.tables.get(name) if isinstance(name, str) else None
        if table is None:
            raise UnknownTableError(f"no embedding table named {name!r} on this server; it "
                                    f"holds {sorted(self.tables)}")
        return table

    def resolve(self, names: Any) -> list[EmbeddingTable]:
        if not isinstance(names, list) or not names:
            raise ProtocolError("field 'tables' must be a non-empty list of table names")
        return [self.table(n) for n in names]

    def pull(self, names: Any, ids: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Rows for one id array per table; every table and id array is checked first."""
        tables = self.resolve(names)
        if len(ids) != len(tables):
            raise ProtocolError(f"{len(tables)} tables but {len(ids)} id arrays; expected one "
                                "id array per table")
        check_ids(tables, ids, reading=True)
        if len({t.name for t in tables}) < len(tables):  # a table twice: one after the other
            return [t.read(i) for t, i in zip(tables, ids, strict=True)]
        found = [None if t.sketch else t.missing(i) for t, i in zip(tables, ids, strict=True)]
        new_rows = _initial_rows(tables, found)
        return [t.read(i, f, r) for t, i, f, r in zip(tables, ids, found, new_rows, strict=True)]

    def push(self, names: Any, ids: Sequence[np.ndarray], grads: Sequence[np.ndarray]) -> None:
        """Apply row gradients, one (ids, grads) pair per table, all checked first."""
        tables = self.resolve(names)
        if len(ids) != len(tables) or len(grads) != len(tables):
            raise ProtocolError(f"{len(tables)} tables but {len(ids)} id and {len(grads)} "
                                "gradient arrays; expected one of each per table")
        check_grads(tables, ids, grads)
        for table, table_ids, table_grads in zip(tables, ids, grads, strict=True):
            table.apply(table_ids, table_grads)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {name: t.stats() for name, t in self.tables.items()}

    def summary(self) -> dict[str, int]:
        """Rows, bytes, evictions, expiries, admissions and rejected row pushes over every
        table (what a server's heartbeat reports, and so ``hogshard status``)."""
        keys = ("rows", "bytes", "evicted", "expired", "admitted", "rejected")
        tables = [t.stats() for t in self.tables.values()]
        return {key: int(sum(t[key] for t in tables)) for key in keys}

    # ---- checkpoint -------------------------------------------------------------------------

    def save(self, path: str | Path) -> int:
        """Write every table's touched rows, optimizer state and admission sketch to ``path``
        (an ``.npz``, written atomically and fsynced); returns the rows written."""
        arrays: dict[str, np.ndarray] = {}
        specs, total = [], 0
        for i, table in enumerate(self.tables.values()):
            ids, slots = table.index.items()
            specs.append(table.spec.to_wire())
            arrays[f"{i}.ids"], arrays[f"{i}.weights"] = ids, table.rows_at(slots)
            for key, array in table.state.items():
                arrays[f"{i}.state.{key}"] = array[slots]
            if table.sketch is not None:  # ids on their way to admission keep their counts
                arrays[f"{i}.sketch"] = table.sketch.counts
            total += ids.size
        arrays["specs"] = np.frombuffer(json.dumps(specs).encode(), dtype=np.uint8)

        def write(f: Any) -> None:
            np.savez(f, **arrays)  # type: ignore[arg-type]  # stubs: ** meets allow_pickle

        atomic_write(Path(path), write)  # a failed write leaves no temporary file
        return total

    def load(self, path: str | Path) -> None:
        """Replace every table with the contents of a checkpoint written by :meth:`save`."""
        try:
            with np.load(Path(path)) as data:
                specs = json.loads(bytes(data["specs"]).decode())
                tables = {}
                for i, fields in enumerate(specs):
                    table = EmbeddingTable(EmbeddingSpec.from_wire(fields))
                    ids = data[f"{i}.ids"]
                    slots = table._allocate(ids.size)
                    table.set_rows(slots, data[f"{i}.weights"].astype(FLOAT32))
                    for key in table.state:
                        table.state[key][slots] = data[f"{i}.state.{key}"]
                    table.slot_ids[slots] = ids
                    table.index.insert(ids, slots)
                    if table.sketch is not None and f"{i}.sketch" in data.files:
                        table.sketch.restore(data[f"{i}.sketch"])
                    tables[table.name] = table
        except (OSError, KeyError, ValueError) as err:
            raise HogshardError(f"cannot load embedding checkpoint {path}: {err}") from None
        self.tables = tables
