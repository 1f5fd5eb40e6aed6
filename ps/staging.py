"""Pushes held until their step ends: the buckets a worker pushes while backward still runs.

A ``push`` with ``partial`` carries gradients of a step that has not ended on the worker: a
worker with overlap on pushes buckets from backward hooks, and may still change the gradients
before its step (clipping, a GradScaler's unscale, an edit of its own). The server keeps them
unapplied, per sender and table, and applies them together with the step's closing push (the
same ``clock``, without ``partial``), whose own chunks replace staged ones of the same id.
Staged gradients of another clock are dropped when new ones come (a step the worker skipped),
and those of a sender that left with it.

Example::

    staging = StagedPushes()
    staging.stage("worker-0", "model", 3, [0, 1], grads, [5, 5])
    ids, grads, versions = staging.take("worker-0", "model", 3, [1], [g1], [5])
    # ids == [1, 0]: the closing push's chunk 1, then the staged chunk 0
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class _Staged:
    clock: Any
    #: chunk id -> (gradient, pulled version)
    chunks: dict[int, tuple[np.ndarray, int]] = field(default_factory=dict)


class StagedPushes:
    """The partial pushes of each (sender, table) whose step has not ended."""

    def __init__(self) -> None:
        self._staged: dict[tuple[str, str], _Staged] = {}

    def stage(self, sender: str, table: str, clock: Any, chunk_ids: Sequence[int],
              grads: Sequence[np.ndarray], versions: Sequence[int]) -> None:
        """Hold validated gradients of ``sender``'s step ``clock`` (a later one of the same
        chunk replaces it; one of another clock drops what was held)."""
        staged = self._staged.get((sender, table))
        if staged is None or staged.clock != clock:
            staged = self._staged[(sender, table)] = _Staged(clock)
        for chunk_id, grad, version in zip(chunk_ids, grads, versions, strict=True):
            staged.chunks[chunk_id] = (grad, version)

    def take(self, sender: str, table: str, clock: Any, chunk_ids: Sequence[int],
             grads: Sequence[np.ndarray], versions: Sequence[int]
             ) -> tuple[list[int], list[np.ndarray], list[int]]:
        """The closing push of a step with what was staged for it appended (chunks the push
        carries itself are taken from the push)."""
        ids, all_grads, all_versions = list(chunk_ids), list(grads), list(versions)
        staged = self._staged.pop((sender, table), None)
        if staged is None or staged.clock != clock:
            return ids, all_grads, all_versions
        mine = set(chunk_ids)
        for chunk_id, (grad, version) in staged.chunks.items():
            if chunk_id not in mine:
                ids.append(chunk_id)
                all_grads.append(grad)
                all_versions.append(version)
        return ids, all_grads, all_versions

    def keep_only(self, senders: Collection[str]) -> None:
        """Drop what senders not in ``senders`` (those gone) staged."""
        for key in [k for k in self._staged if k[0] not in senders]:
            del self._staged[key]

    def drop(self, chunks: Collection[tuple[str, int]]) -> int:
        """Drop what is staged for ``chunks`` ((table, chunk id) pairs: they leave this
        server); returns how many gradients were dropped."""
        dropped = 0
        for (_, table), staged in self._staged.items():
            for chunk_id in [c for c in staged.chunks if (table, c) in chunks]:
                del staged.chunks[chunk_id]
                dropped += 1
        return dropped

    @property
    def chunks(self) -> int:
        """Gradients held now."""
        return sum(len(s.chunks) for s in self._staged.values())
