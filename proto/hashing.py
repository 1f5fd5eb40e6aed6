"""Stable, vectorised 64-bit hashing: row routing and deterministic row initialisation.

Everything here is a pure function of its inputs (never Python's salted ``hash()``), so every
process, on every host and in every run, routes an embedding id to the same shard and creates
the same initial row for it.

- :func:`splitmix64` mixes a uint64 array (Steele, Lea and Flood's SplitMix64 finaliser).
- :func:`shard_of` is ``splitmix64(id) % num_shards``: the server that owns a row.
- :func:`name_key` turns a table name into a 64-bit key (BLAKE2b, 8 bytes).
- :func:`init_rows` is counter-based: row ``id`` of table ``name`` under ``seed`` is a function
  of those three values alone, computed for a whole batch at once.

Example::

    >>> import numpy as np
    >>> shard_of(np.array([0, 1, 2, 3], dtype=np.int64), 2).tolist()
    [1, 1, 0, 1]
    >>> rows = init_rows(seed=0, table="t", ids=np.array([5, 5]), dim=4, scale=0.1)
    >>> bool((rows[0] == rows[1]).all()), rows.dtype.str
    (True, '<f4')
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)

#: Largest id an embedding table accepts, exclusive (ids are non-negative int64).
MAX_ID = 1 << 63


def as_uint64(values: np.ndarray) -> np.ndarray:
    """Reinterpret int64 (or copy other integer dtypes) as uint64, bit for bit."""
    values = np.asarray(values)
    if values.dtype == np.uint64:
        return values
    if values.dtype == np.int64:
        return values.view(np.uint64)
    return values.astype(np.int64).view(np.uint64)


def splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64 of every element (uint64 arithmetic wraps modulo 2^64).

    Example::

        >>> hex(int(splitmix64(np.array([0], dtype=np.uint64))[0]))
        '0xe220a8397b1dcdaf'
    """
    z = as_uint64(values) + _GOLDEN
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard index (0 .. num_shards-1) that owns each id, as int64."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1; got {num_shards}")
    return (splitmix64(ids) % np.uint64(num_shards)).astype(np.int64)


def name_key(name: str) -> int:
    """A stable 64-bit key for a string (BLAKE2b with an 8-byte digest)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def hash_strings(values: list[str] | np.ndarray, namespace: str = "") -> np.ndarray:
    """Non-negative int64 ids for strings (e.g. hashed categorical features), stable."""
    out = np.empty(len(values), dtype=np.int64)
    for i, value in enumerate(values):
        digest = hashlib.blake2b(f"{namespace}\x00{value}".encode(), digest_size=8).digest()
        out[i] = int.from_bytes(digest, "little") & (MAX_ID - 1)
    return out


def uniform01(keys: np.ndarray) -> np.ndarray:
    """A float64 in [0, 1) per uint64 key (the top 53 bits of its SplitMix64)."""
    return (splitmix64(keys) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@functools.lru_cache(maxsize=4096)  # a pure function, asked again by every request
def table_key(seed: int, table: str) -> np.uint64:
    """The 64-bit key of (seed, table name) that every row key of the table mixes in."""
    mixed = ((int(seed) * 0x2545F4914F6CDD1D) ^ name_key(table)) & 0xFFFFFFFFFFFFFFFF
    return splitmix64(np.array([mixed], dtype=np.uint64))[0]


def init_rows(seed: int, table: str, ids: np.ndarray, dim: int, scale: float) -> np.ndarray:
    """Initial rows, uniform in [-scale, scale), shape ``(len(ids), dim)`` float32.

    Element ``j`` of row ``id`` is ``uniform01(key(id) + j * golden)``, so a row never depends
    on which other rows were created with it, or in what order."""
    return init_rows_of_tables([(seed, table, ids)], dim, scale)[0]


def init_rows_of_tables(
    parts: Sequence[tuple[int, str, np.ndarray]], dim: int, scale: float
) -> list[np.ndarray]:
    """:func:`init_rows` of each ``(seed, table, ids)`` (tables of one ``dim`` and ``scale``),
    computed in one pass over all their rows: a shard's pull that creates rows in many tables
    pays the numpy calls once, not once per table.

    Example::

        >>> ids = np.array([3, 9], dtype=np.int64)
        >>> a, b = init_rows_of_tables([(0, "a", ids), (1, "b", ids[:1])], dim=2, scale=0.1)
        >>> bool((a == init_rows(0, "a", ids, 2, 0.1)).all()), b.shape
        (True, (1, 2))
    """
    ids = [as_uint64(np.asarray(i).reshape(-1)) for _, _, i in parts]
    sizes = [i.size for i in ids]
    bases = np.array([table_key(seed, table) for seed, table, _ in parts], dtype=np.uint64)
    keys = np.concatenate(ids) ^ np.repeat(bases, sizes)
    counters = np.arange(dim, dtype=np.uint64) * _GOLDEN
    u = uniform01(splitmix64(keys)[:, None] + counters[None, :])
    rows = ((u * 2.0 - 1.0) * scale).astype(np.float32)
    return np.split(rows, np.cumsum(sizes)[:-1])
