"""All embedding tables of one server: requests validated whole, then served in one pass per
row block (ps/row_block.py): the tables of one dim, storage and rule with declared sizes below
2^56 and no admission share a block, and a request's tables of one block are served together
(ps/embedding_fused.py); the other tables one by one (the rows a pull creates in many tables
are initialised in one pass).

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
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hogshard.proto.errors import (
    CheckpointError,
    ConflictError,
    HogshardError,
    ProtocolError,
    UnknownTableError,
)
from hogshard.proto.hashing import init_rows_of_tables
from hogshard.proto.packed_rows import pack
from hogshard.proto.tables import EmbeddingSpec
from hogshard.ps.disk_table import DiskTable, DiskTier
from hogshard.ps.embedding import EmbeddingTable, Found
from hogshard.ps.embedding_checkpoint import Tick, load_tables, save_tables
from hogshard.ps.embedding_fused import fused_pull, fused_push
from hogshard.ps.row_block import ID_SPAN, MAX_TABLES, RowBlock
from hogshard.ps.row_checks import check_finite, check_grads, check_ids


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


def _by_block(tables: Sequence[EmbeddingTable]) -> list[list[int]]:
    """The positions of ``tables`` grouped by the block they share (a table alone in its block
    forms a group of one)."""
    groups: dict[int, list[int]] = {}
    for t, table in enumerate(tables):
        groups.setdefault(id(table.block) if table.index.base else -1 - t, []).append(t)
    return list(groups.values())


class EmbeddingStore:
    """All embedding tables held by one server."""

    def __init__(self, disk: DiskTier | None = None) -> None:
        self.disk = disk  # where tables big enough go to disk (None: every table in RAM)
        self.tables: dict[str, EmbeddingTable] = {}
        self.blocks: dict[str, list[RowBlock]] = {}  # shared blocks by what their tables share

    def _new_table(self, spec: EmbeddingSpec) -> EmbeddingTable:
        """A table for ``spec``, in a shared block where it can join one: tables of one dim,
        storage and rule, with declared sizes up to 2^56 and no admission."""
        n = spec.num_embeddings
        if self.disk is not None and self.disk.holds(spec):
            return DiskTable(spec, self.disk.directory)
        if n is None or n > ID_SPAN or (spec.admit_after is not None and spec.admit_after > 1):
            return EmbeddingTable(spec)
        table = EmbeddingTable(spec, block=RowBlock(spec.dim, spec.storage, {}, 0))  # checks
        key = json.dumps([spec.dim, spec.storage, table.rule.spec()], sort_keys=True)
        blocks = self.blocks.setdefault(key, [])
        if not blocks or blocks[-1].members >= MAX_TABLES:
            blocks.append(RowBlock(spec.dim, spec.storage, table.rule.state_layout(spec.dim)))
        block = blocks[-1]
        block.members += 1
        return EmbeddingTable(spec, block=block, number=block.members)

    def create(self, spec: EmbeddingSpec) -> bool:
        """Create a table; idempotent for an identical spec (returns False), CONFLICT else."""
        existing = self.tables.get(spec.name)
        if existing is not None:
            if existing.spec != spec:
                raise ConflictError(f"embedding table {spec.name!r} exists as "
                                    f"{existing.spec.to_wire()}; got {spec.to_wire()}")
            return False
        table = self._new_table(spec)  # builds the rule: a bad rule raises before insertion
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

    def pull(self, names: Any, ids: Sequence[np.ndarray], packed: bool = False
             ) -> list[np.ndarray]:
        """Rows for one id array per table; every table and id array is checked first.
        ``packed``: one flat array of every table's rows, in order (a packed reply)."""
        tables = self.resolve(names)
        if len(ids) != len(tables):
            raise ProtocolError(f"{len(tables)} tables but {len(ids)} id arrays; expected one "
                                "id array per table")
        check_ids(tables, ids, reading=True)
        if len({t.name for t in tables}) < len(tables):  # a table twice: one after the other
            each = [t.read(i) for t, i in zip(tables, ids, strict=True)]
            return [pack(each)] if packed else each
        groups = _by_block(tables)
        if packed and len(groups) == 1 and len(tables) > 1:  # already in order: no copy
            return [fused_pull(tables, ids, split=False)[0].reshape(-1)]
        out: list[np.ndarray | None] = [None] * len(tables)
        single = []
        for members in groups:
            if len(members) == 1:
                single.append(members[0])
                continue
            parts = fused_pull([tables[t] for t in members], [ids[t] for t in members])
            for m, part in zip(members, parts, strict=True):
                out[m] = part
        if single:
            alone = [tables[t] for t in single]
            found = [None if a.sketch else a.missing(ids[i])
                     for i, a in zip(single, alone, strict=True)]
            new_rows = _initial_rows(alone, found)
            for i, a, f, r in zip(single, alone, found, new_rows, strict=True):
                out[i] = a.read(ids[i], f, r)
        rows = [part for part in out if part is not None]
        return [pack(rows)] if packed else rows

    def push(self, names: Any, ids: Sequence[np.ndarray], grads: Sequence[np.ndarray],
             packed: np.ndarray | None = None) -> None:
        """Apply row gradients, one (ids, grads) pair per table, all checked first.
        ``packed``: every table's gradient rows in one flat array, in order, of which
        ``grads`` are the views (a packed push: one block's rows need no joining then)."""
        tables = self.resolve(names)
        if len(ids) != len(tables) or len(grads) != len(tables):
            raise ProtocolError(f"{len(tables)} tables but {len(ids)} id and {len(grads)} "
                                "gradient arrays; expected one of each per table")
        if len({t.name for t in tables}) < len(tables):  # a table twice: one after the other
            check_grads(tables, ids, grads)
            for table, table_ids, table_grads in zip(tables, ids, grads, strict=True):
                table.apply(table_ids, table_grads)
            return
        check_grads(tables, ids, grads, finite=False)
        groups = _by_block(tables)
        joined = []  # each block's gradients in one array, checked finite in one pass
        whole = packed is not None and len(groups) == 1 and len(tables) > 1
        for members in groups:
            parts = [tables[t] for t in members], [grads[t] for t in members]
            if whole and packed is not None:
                flat = packed.reshape(-1, tables[0].spec.dim)
            else:
                flat = parts[1][0] if len(members) == 1 else np.concatenate(parts[1])
            if not np.isfinite(flat).all():
                check_finite(*parts)
            joined.append(flat)
        for members, flat in zip(groups, joined, strict=True):
            if len(members) == 1:
                tables[members[0]].apply(ids[members[0]], flat)
            else:
                fused_push([tables[t] for t in members], [ids[t] for t in members], flat)

    def assign(self, names: Any, ids: Sequence[np.ndarray], rows: Sequence[np.ndarray]) -> None:
        """Set rows, one (ids, rows) pair per table (``emb_assign``), all checked first as a
        push's are."""
        tables = self.resolve(names)
        if len(ids) != len(tables) or len(rows) != len(tables):
            raise ProtocolError(f"{len(tables)} tables but {len(ids)} id and {len(rows)} row "
                                "arrays; expected one of each per table")
        check_grads(tables, ids, rows)
        for table, table_ids, table_rows in zip(tables, ids, rows, strict=True):
            table.assign(table_ids, table_rows)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {name: t.stats() for name, t in self.tables.items()}

    def summary(self) -> dict[str, int]:
        """Rows, bytes, evictions, expiries, admissions and rejected row pushes over every
        table (what a server's heartbeat reports, and so ``hogshard status``)."""
        keys = ("rows", "bytes", "evicted", "expired", "admitted", "rejected")
        tables = [t.stats() for t in self.tables.values()]
        return {key: int(sum(t[key] for t in tables)) for key in keys}

    # ---- checkpoint -------------------------------------------------------------------------

    def save(self, path: str | Path, tick: Tick | None = None) -> int:
        """Write every table's touched rows, optimizer state and admission sketch to ``path``
        (an ``.npz``, written atomically and fsynced, a block of rows at a time:
        ps/embedding_checkpoint.py; ``tick`` after each block); returns the rows written."""
        return save_tables(self.tables.values(), Path(path), tick)

    def load(self, path: str | Path) -> None:
        """Replace every table with the contents of a checkpoint written by :meth:`save`
        (into disk tables where this store keeps tables on disk)."""
        loaded = EmbeddingStore(self.disk)
        try:
            load_tables(loaded, Path(path))
        except (OSError, KeyError, ValueError, zipfile.BadZipFile, CheckpointError) as err:
            why = err.message if isinstance(err, CheckpointError) else err
            raise HogshardError(f"cannot load embedding checkpoint {path}: {why}") from None
        self.tables, self.blocks = loaded.tables, loaded.blocks
