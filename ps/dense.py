"""Dense tables on a shard: float32 chunks, a version per chunk, server-side optimizer state.

Every request is validated whole before any chunk changes, so a bad request changes nothing.

Example::

    >>> import numpy as np
    >>> store = DenseStore()
    >>> store.init("model", {"rule": "sgd", "lr": 0.5}, [(0, 0, 3)], [np.ones(3, "<f4")])
    >>> table, chunks = store.validate_push("model", [0], [np.ones(3, "<f4")], [0])
    >>> [c.chunk_id for c in chunks], chunks[0].version   # ps/applier.py applies it
    ([0], 0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hogshard.proto.codecs import Codec
from hogshard.proto.codecs.pull import encode_weights
from hogshard.proto.errors import (
    ConflictError,
    DtypeError,
    ProtocolError,
    ShapeError,
    UnknownChunkError,
    UnknownTableError,
)
from hogshard.proto.rule_groups import check_table_rule, first_group_rule
from hogshard.ps.rules import UpdateRule, make_rule
from hogshard.ps.table_rules import TableRules

FLOAT32 = np.dtype("<f4")


@dataclass
class DenseChunk:
    """A slice of a table's flat vector; ``version`` counts the updates applied to it."""

    chunk_id: int
    offset: int
    weights: np.ndarray
    state: dict[str, Any]
    version: int = 0
    #: The gradients its updates applied (a group update counts each of its gradients).
    gradients: int = 0
    #: The ZeroMQ tracker of the last pull reply that carried ``weights`` without a copy.
    in_flight: Any = None
    #: The weights of one version in a pull codec, ``(codec name, version, array)``: pulls of
    #: that version in that codec share it (the array is never written, only replaced).
    encoded: tuple[str, int, np.ndarray] | None = field(default=None, repr=False)

    def writable(self) -> np.ndarray:
        """The weights, safe to update in place. Pull replies send the live buffer without a
        copy; if one is still leaving when an update comes, the weights move to a fresh buffer
        first (copy on write) and the reply keeps the old one."""
        if self.in_flight is not None:
            if not self.in_flight.done:
                self.weights = self.weights.copy()
            self.in_flight = None
        return self.weights


@dataclass
class DenseTable:
    """A table's chunks on this server; ``rule`` is its first parameter group's rule and
    ``rules`` every group's, and those for a push's live hyperparameters (ps/table_rules.py)."""

    name: str
    rule: UpdateRule
    rule_spec: dict[str, Any]
    chunks: dict[int, DenseChunk] = field(default_factory=dict)
    rules: TableRules = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rules = TableRules(self.rule_spec, first=self.rule)

    @classmethod
    def from_spec(cls, name: str, rule_spec: dict[str, Any]) -> DenseTable:
        """A table with no chunks yet, its rules built from ``rule_spec`` (ConfigError if bad)."""
        checked = check_table_rule(rule_spec)
        return cls(name, make_rule(first_group_rule(checked)), dict(rule_spec))

    def new_state(self, chunk: DenseChunk) -> dict[str, Any]:
        """Fresh optimizer state for ``chunk``, by its group's rule."""
        return self.rules.registered_for(chunk.offset).new_state(chunk.weights.size)

    def chunk(self, chunk_id: Any) -> DenseChunk:
        found = (self.chunks.get(chunk_id) if isinstance(chunk_id, int)
                 and not isinstance(chunk_id, bool) else None)
        if found is None:
            raise UnknownChunkError(
                f"table {self.name!r} has no chunk {chunk_id!r} on this server; it holds "
                f"chunks {sorted(self.chunks)}"
            )
        return found


def check_arrays(
    name: str, chunks: Sequence[DenseChunk], arrays: Sequence[np.ndarray]
) -> None:
    """Raise unless there is one float32 array per chunk, each of the chunk's length."""
    if len(arrays) != len(chunks):
        raise ProtocolError(
            f"table {name!r}: {len(chunks)} chunk ids but {len(arrays)} arrays; expected one "
            "array per chunk"
        )
    for chunk, array in zip(chunks, arrays, strict=True):
        if array.dtype != FLOAT32:
            raise DtypeError(
                f"table {name!r} chunk {chunk.chunk_id}: got dtype {array.dtype.str}; "
                "expected float32 ('<f4')"
            )
        if array.shape != chunk.weights.shape:
            raise ShapeError(
                f"table {name!r} chunk {chunk.chunk_id}: got shape {list(array.shape)}; "
                f"expected {list(chunk.weights.shape)}"
            )


class DenseStore:
    """All dense tables held by one server. With ``check_finite`` (the default) a push whose
    gradient holds NaN or Inf is refused; that costs one read of the gradient."""

    def __init__(self, check_finite: bool = True) -> None:
        self.tables: dict[str, DenseTable] = {}
        self.check_finite = check_finite
        #: name -> (size, chunk_elems) of the whole table, where its client sent them.
        self.sizes: dict[str, tuple[int, int]] = {}

    def table(self, name: Any) -> DenseTable:
        table = self.tables.get(name) if isinstance(name, str) else None
        if table is None:
            raise UnknownTableError(
                f"no dense table named {name!r} on this server; it holds {sorted(self.tables)}"
            )
        return table

    def init(
        self,
        name: str,
        rule_spec: dict[str, Any],
        layout: Sequence[tuple[int, int, int]],
        values: Sequence[np.ndarray],
    ) -> None:
        """Create chunks ``(chunk_id, offset, length)`` with initial values. Idempotent for
        chunks that exist with the same layout (the first initialisation wins)."""
        if not isinstance(name, str) or not name:
            raise ProtocolError("field 'table' must be a non-empty string")
        table = self.tables.get(name)
        if table is not None and table.rule_spec != dict(rule_spec):
            raise ConflictError(
                f"table {name!r} exists with rule {table.rule_spec}; got {dict(rule_spec)}"
            )
        if table is None:
            table = DenseTable.from_spec(name, dict(rule_spec))
        if len(values) != len(layout):
            raise ProtocolError(
                f"init of {name!r}: {len(layout)} chunks but {len(values)} arrays"
            )
        ids = [entry[0] for entry in layout]
        if len(set(ids)) != len(ids):
            raise ConflictError(f"init of {name!r} lists a chunk id twice: {ids}")
        fresh = []
        for (chunk_id, offset, length), array in zip(layout, values, strict=True):
            if not (isinstance(length, int) and isinstance(offset, int) and offset >= 0
                    and array.ndim == 1 and length == array.size):
                raise ShapeError(
                    f"init of {name!r} chunk {chunk_id}: layout says offset {offset} length "
                    f"{length}; expected a 1-D float32 array of that length, got shape "
                    f"{list(array.shape)}"
                )
            existing = table.chunks.get(chunk_id)
            if existing is not None:
                if existing.offset != offset or existing.weights.size != length:
                    raise ConflictError(
                        f"table {name!r} chunk {chunk_id} exists at offset {existing.offset} "
                        f"length {existing.weights.size}; got offset {offset} length {length}"
                    )
                continue
            table.rules.shapes_at(offset, length)  # a shape-aware rule's chunk: whole parameters
            probe = DenseChunk(chunk_id, offset, np.empty(length, FLOAT32), {})
            check_arrays(name, [probe], [array])
            fresh.append((probe, array))
        self.tables[name] = table
        for chunk, array in fresh:
            np.copyto(chunk.weights, array)
            chunk.state = table.new_state(chunk)
            table.chunks[chunk.chunk_id] = chunk

    def resolve(self, name: Any, chunk_ids: Any) -> tuple[DenseTable, list[DenseChunk]]:
        table = self.table(name)
        if not isinstance(chunk_ids, list):
            raise ProtocolError("field 'chunks' must be a list of chunk ids")
        held, chunks = table.chunks, []
        for chunk_id in chunk_ids:
            found = held.get(chunk_id) if type(chunk_id) is int else None
            chunks.append(found if found is not None else table.chunk(chunk_id))
        return table, chunks

    def check_grads_finite(self, table: DenseTable, chunks: Sequence[DenseChunk],
                           grads: Sequence[np.ndarray],
                           passed: Sequence[bool] | None = None) -> None:
        """Refuse a gradient holding NaN or Inf (unless ``check_finite`` is off). ``passed``:
        per gradient, True where it is already known to pass (ps/decoding.py: a sparse
        payload's values were checked), so it is not read again."""
        if not self.check_finite:
            return
        for index, (chunk, grad) in enumerate(zip(chunks, grads, strict=True)):
            if passed is not None and passed[index]:
                continue
            # one BLAS pass: NaN or Inf anywhere makes the sum of squares non-finite
            if grad.size and not math.isfinite(np.dot(grad, grad)):
                raise ProtocolError(
                    f"table {table.name!r} chunk {chunk.chunk_id}: the gradient holds NaN "
                    "or Inf (or overflows); expected finite values"
                )

    def validate_push(
        self, name: Any, chunk_ids: Any, grads: Sequence[np.ndarray], pulled_versions: Any,
        check_finite: bool = True, passed: Sequence[bool] | None = None,
    ) -> tuple[DenseTable, list[DenseChunk]]:
        """Check a whole push (table, chunks, arrays, versions) before anything changes (the
        gradients' values too, unless ``check_finite`` is false: a partial push's are checked
        when its step ends; ``passed``: see :meth:`check_grads_finite`)."""
        table, chunks = self.resolve(name, chunk_ids)
        if len(chunks) > 1 and len(set(chunk_ids)) != len(chunk_ids):
            raise ProtocolError(f"push to {table.name!r} lists a chunk twice: {chunk_ids}")
        check_arrays(table.name, chunks, grads)
        if check_finite:
            self.check_grads_finite(table, chunks, grads, passed)
        versions_ok = isinstance(pulled_versions, list) and len(pulled_versions) == len(chunks)
        if versions_ok:
            for version in pulled_versions:
                if type(version) is not int or version < 0:  # bool is not a version
                    versions_ok = False
                    break
        if not versions_ok:
            raise ProtocolError(
                "field 'versions' must list one non-negative pulled version per chunk"
            )
        return table, chunks



def encoded_weights(codec: Codec, chunks: Sequence[DenseChunk],
                    arrays: Sequence[np.ndarray], versions: Sequence[int]) -> list[np.ndarray]:
    """Each chunk's weights (``arrays``, of ``versions``) in ``codec``, encoded once per
    version: pulls of a version that another pull already encoded reuse it."""
    encoded = []
    for chunk, array, version in zip(chunks, arrays, versions, strict=True):
        cached = chunk.encoded
        if cached is None or cached[0] != codec.name or cached[1] != version:
            cached = chunk.encoded = (codec.name, version, encode_weights(codec, [array])[0])
        encoded.append(cached[2])
    return encoded
