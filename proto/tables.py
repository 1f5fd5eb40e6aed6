"""What workers, servers and the scheduler agree on about tables: dense table and chunk specs,
embedding table specs, and the name of the embedding shards' map.

Example::

    >>> Chunk.from_wire([3, 0, 1024, 1]).to_wire()
    [3, 0, 1024, 1]
    >>> EmbeddingSpec("user", dim=8, num_embeddings=None, rule={"rule": "sgd"}).scale
    0.01
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

from hogshard.proto.errors import HogshardError, ProtocolError
from hogshard.proto.hashing import MAX_ID
from hogshard.proto.policy import AsyncPolicy, SSPPolicy, parse_policy

#: 1 Mi float32 elements = 4 MiB chunks by default.
DEFAULT_CHUNK_ELEMS = 1 << 20


@dataclass(frozen=True)
class Chunk:
    """One contiguous slice ``[offset, offset + length)`` of a dense table, owned by ``server``
    (the primary, which workers talk to) and copied on ``backup`` (-1: no copy). An embedding
    slot of a replicated job that moves names its next owner, ``moving_to`` (-1: none)."""

    chunk_id: int
    offset: int
    length: int
    server: int
    backup: int = -1
    moving_to: int = -1

    def to_wire(self) -> list[int]:
        """``[chunk_id, offset, length, server]``, with ``backup`` as a fifth entry if any,
        and ``moving_to`` as a sixth (after the backup, -1 if none) while a slot moves."""
        head = [self.chunk_id, self.offset, self.length, self.server]
        if self.moving_to >= 0:
            return [*head, self.backup, self.moving_to]
        return head if self.backup < 0 else [*head, self.backup]

    @classmethod
    def from_wire(cls, fields: list[int]) -> Chunk:
        return cls(*fields)


@dataclass(frozen=True)
class DenseTableSpec:
    """What a worker declares: a table's name, element count, chunk size and update rule,
    and where known the parameter layout (:mod:`hogshard.proto.param_layout`)."""

    name: str
    size: int
    chunk_elems: int
    rule: dict[str, Any]
    params: list[Any] | None = None

    def to_wire(self) -> dict[str, Any]:
        """The spec's fields; ``params`` only where the table has a layout."""
        fields = asdict(self)
        if fields["params"] is None:
            del fields["params"]
        return fields


#: The map of embedding shards under replication: a pseudo-table whose "chunk" i is embedding
#: shard i (rows with ``splitmix64(id) % S == i``), placed and promoted like dense chunks.
EMBEDDING_MAP = "__embeddings__"
#: The most embedding slots a job may have (the slot map travels in ``get_table`` replies).
MAX_SLOTS = 1 << 16

#: How a shard may hold a table's rows (``EmbeddingSpec.storage``).
ROW_STORAGE = ("fp32", "fp16", "bf16")

#: The widest embedding row a table may declare.
MAX_DIM = 1 << 16


@dataclass(frozen=True)
class EmbeddingSpec:
    """What a worker declares. ``init_scale`` None means ``sqrt(1 / num_embeddings)`` (DLRM's
    uniform init) for a bounded table and 0.01 for an unbounded one. Memory bounds, per shard:
    ``max_rows`` (least recently used rows evicted beyond it), ``admit_after`` (a row is
    created only when a push carries its id for the N-th time; before, its pushes are dropped
    and a pull returns its initial row) and ``ttl`` (a row no push touched in the shard's last
    ``ttl`` pushes to the table expires). ``storage``: how a shard holds the rows, ``fp32``
    or half precision (``fp16``, ``bf16``: half the bytes; the rule computes in float32 and its
    state stays float32). ``policy``: ``async`` (pulls served at once) or ``ssp:S`` (a pull
    for step c waits until every live worker's row pushes reached step c - S; PROTOCOL.md
    section 13.3), whatever policy the dense tables run."""

    name: str
    dim: int
    num_embeddings: int | None
    rule: dict[str, Any]
    seed: int = 0
    init_scale: float | None = None
    max_rows: int | None = None
    admit_after: int | None = None
    ttl: int | None = None
    storage: str = "fp32"
    policy: str = "async"

    def __post_init__(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not isinstance(self.name, str) or not self.name:
            raise ProtocolError("embedding table 'table' must be a non-empty string")
        if not is_int(self.dim) or not 1 <= self.dim <= MAX_DIM:
            raise ProtocolError(f"table {self.name!r}: 'dim' must be an int in [1, {MAX_DIM}]; "
                                f"got {self.dim!r}")
        n = self.num_embeddings
        if n is not None and (not is_int(n) or not 1 <= n <= MAX_ID):
            raise ProtocolError(f"table {self.name!r}: 'num_embeddings' must be nil or an int "
                                f"in [1, 2^63]; got {n!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 1 << 63:
            raise ProtocolError(f"table {self.name!r}: 'seed' must be an int in [0, 2^63)")
        s = self.init_scale
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float))
                              or not math.isfinite(s) or s < 0):
            raise ProtocolError(f"table {self.name!r}: 'init_scale' must be nil or a finite "
                                f"number >= 0; got {s!r}")
        m = self.max_rows
        if m is not None and (not is_int(m) or m < 1):
            raise ProtocolError(f"table {self.name!r}: 'max_rows' must be nil or an int >= 1")
        for key in ("admit_after", "ttl"):
            v = getattr(self, key)
            if v is not None and (not is_int(v) or not 1 <= v < 1 << 31):
                raise ProtocolError(f"table {self.name!r}: {key!r} must be nil or an int in "
                                    f"[1, 2^31); got {v!r}")
        if self.storage not in ROW_STORAGE:
            raise ProtocolError(f"table {self.name!r}: 'storage' must be one of "
                                f"{', '.join(ROW_STORAGE)}; got {self.storage!r}")
        row_staleness_bound(self.policy, self.name)

    @cached_property
    def staleness_bound(self) -> int | None:
        """S of an ``ssp:S`` table, None for ``async`` (parsed once: every row request asks)."""
        return row_staleness_bound(self.policy, self.name)

    @property
    def scale(self) -> float:
        if self.init_scale is not None:
            return float(self.init_scale)
        return math.sqrt(1.0 / self.num_embeddings) if self.num_embeddings else 0.01

    def to_wire(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["table"] = fields.pop("name")
        return fields

    @classmethod
    def from_wire(cls, fields: dict[str, Any]) -> EmbeddingSpec:
        rule = fields.get("rule")
        if not isinstance(rule, dict):
            raise ProtocolError("field 'rule' must be a map {rule: NAME, ...params}")
        # each value is checked by __post_init__, whatever type the peer sent
        values: dict[str, Any] = {
            "name": fields.get("table"), "dim": fields.get("dim"),
            "num_embeddings": fields.get("num_embeddings"), "rule": dict(rule),
            "seed": fields.get("seed", 0), "init_scale": fields.get("init_scale"),
            "max_rows": fields.get("max_rows"), "admit_after": fields.get("admit_after"),
            "ttl": fields.get("ttl"), "storage": fields.get("storage", "fp32"),
            "policy": fields.get("policy", "async")}
        return cls(**values)


def row_staleness_bound(policy: Any, table: str) -> int | None:
    """S of an embedding table's ``ssp:S`` policy, None for ``async``; ProtocolError for
    anything else (no other policy, no modifiers).

    >>> row_staleness_bound("ssp:2", "user"), row_staleness_bound("async", "user")
    (2, None)
    """
    try:
        parsed = parse_policy(policy) if isinstance(policy, str) else None
    except HogshardError:
        parsed = None
    if isinstance(parsed, AsyncPolicy) and parsed.base_spec == policy:
        return None
    if isinstance(parsed, SSPPolicy) and parsed.base_spec == policy:
        return parsed.staleness
    raise ProtocolError(f"table {table!r}: 'policy' must be 'async' or 'ssp:S' (S an int "
                        f">= 0, no modifiers); got {policy!r}")
