"""The scheduler's checkpoint handlers: start a round (on request or periodically), describe
the job for the manifest, and restore the shard map, policy and clocks from a checkpoint.

The rounds themselves (which servers have written, when the manifest is due) are tracked by
:class:`hogshard.scheduler.checkpointing.CheckpointRounds`; PROTOCOL.md section 14.

Example::

    class Scheduler(CheckpointOps): ...
    scheduler._checkpoint(message)      # the 'checkpoint' op: a waiter released when written
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hogshard.proto.errors import ConfigError, ConflictError, HogshardError
from hogshard.proto.manifest import load_manifest, resolve_checkpoint
from hogshard.proto.policy import parse_policy
from hogshard.proto.tables import EMBEDDING_MAP, Chunk, DenseTableSpec
from hogshard.proto.wire import Message
from hogshard.scheduler.checkpointing import Round
from hogshard.scheduler.placement import PlacedTable

log = logging.getLogger(__name__)


class CheckpointOps:
    """Mixed into the Scheduler; uses its ``members``, ``tables``, ``policy``,
    ``expected_servers``, ``checkpoints``, ``lost_shards`` and ``_table_view``."""

    def _job_description(self) -> dict[str, Any]:
        """What the manifest records besides the files: policy, shard map, clocks."""
        return {
            "policy": self.policy.spec, "epoch": self.members.epoch,
            "servers": self.expected_servers,
            "tables": {name: self._table_view(t) for name, t in self.tables.items()},
            "clocks": self.members.live_clocks(),
        }

    def _start_checkpoint(self, parent: Path) -> Any:
        ranks = sorted(m.rank for m in self.members.live("server"))
        if ranks != list(range(self.expected_servers)):
            raise ConflictError(f"live server ranks {ranks}; a checkpoint needs every rank "
                                f"0..{self.expected_servers - 1}")
        lost = self.lost_shards
        if lost.failed is not None or lost.lost:
            raise ConflictError("a checkpoint needs every chunk; lost: "
                                f"{lost.failed or sorted(s.node_id for s in lost.lost.values())}")
        expected: dict[int, dict[str, set[int]]] = {}
        for name, table in self.tables.items():
            if name != EMBEDDING_MAP:
                for chunk in table.chunks:
                    expected.setdefault(chunk.server, {}).setdefault(name, set()).add(
                        chunk.chunk_id)
        return self.checkpoints.start(parent, ranks, self._job_description, time.monotonic(),
                                      expected)

    def _tick_checkpoints(self, now: float) -> None:
        self.checkpoints.check(now, {m.rank for m in self.members.live("server")})
        if self.checkpoints.due(now) and self.tables:  # nothing to save before a table exists
            try:
                self._start_checkpoint(self.checkpoints.directory)
            except HogshardError as err:
                # try again one interval later rather than on every tick
                self.checkpoints.postpone(now)
                log.warning("periodic checkpoint skipped: %s", err.message)

    def _checkpoint(self, msg: Message) -> Callable[[], dict[str, Any] | None]:
        directory = msg.header["dir"]
        return self.checkpoints.waiter(self._start_checkpoint(Path(directory)))

    def _restore(self, path: Path) -> None:
        """Take the shard map, policy and clocks of a checkpoint (every file verified)."""
        ckpt = resolve_checkpoint(path)
        manifest = load_manifest(ckpt)
        if manifest.get("servers") != self.expected_servers:
            raise ConfigError(f"checkpoint {ckpt} was written by {manifest.get('servers')} "
                              f"servers; this job expects {self.expected_servers} (--servers "
                              "must match: the shard map names server ranks)")
        self.policy = parse_policy(manifest["policy"])
        for name, view in manifest.get("tables", {}).items():
            self.tables[name] = PlacedTable(DenseTableSpec(**view["table"]),
                                       [Chunk.from_wire(c) for c in view["chunks"]], ready=True)
        self.restored_clock = min(manifest.get("clocks", {}).values(), default=0)
        self.checkpoints.complete = Round(ckpt, set(range(self.expected_servers)),
                                          self._job_description, 0.0, manifest=manifest)
        self.members.epoch = int(manifest.get("epoch", 0)) + 1
        log.info("restored %s: tables %s, policy %s, clock %d", ckpt, sorted(self.tables),
                 self.policy.spec, self.restored_clock)

