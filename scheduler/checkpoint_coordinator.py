"""The scheduler's part in checkpoints: start a round (on request or periodically) once every
server rank is live and every chunk held, carry it on the servers' heartbeats, and restore the
shard map, policy and clocks of a job from a checkpoint.

The rounds themselves (which servers have written, when the manifest is due) are tracked by
:class:`hogshard.scheduler.checkpointing.CheckpointRounds`; PROTOCOL.md section 14.

Example::

    coordinator = CheckpointCoordinator(rounds, members, shard_map, recovery, describe,
                                        expected_servers=2)
    ready = coordinator.request("/ckpt")   # the 'checkpoint' op: ready() answers once written
    coordinator.tick(time.monotonic())     # the periodic rounds, and a round's deadline
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hogshard.proto.errors import CheckpointError, ConfigError, ConflictError, HogshardError
from hogshard.proto.manifest import load_manifest, manifest_ranks, resolve_checkpoint
from hogshard.proto.policy import ConsistencyPolicy, parse_policy
from hogshard.proto.tables import Chunk, DenseTableSpec
from hogshard.scheduler.checkpointing import CheckpointRounds, Round, checkpoint_folder
from hogshard.scheduler.membership import MembershipTable
from hogshard.scheduler.placement import PlacedTable
from hogshard.scheduler.waiters import Fields, Ready

log = logging.getLogger(__name__)


class Chunks(Protocol):
    """What a checkpoint needs of the shard map: which dense chunks each rank is primary of."""

    @property
    def tables(self) -> dict[str, PlacedTable]: ...

    def primaries(self) -> dict[int, dict[str, set[int]]]: ...


class Completeness(Protocol):
    """What a checkpoint needs of recovery: whether a chunk is lost."""

    def missing(self) -> str | None: ...


class CheckpointCoordinator:
    """Starts rounds of :class:`CheckpointRounds` over the live servers; ``describe()`` is
    what the manifest records besides the files (policy, shard map, clocks)."""

    def __init__(self, rounds: CheckpointRounds, members: MembershipTable, chunks: Chunks,
                 completeness: Completeness, describe: Callable[[], Fields],
                 expected_servers: int) -> None:
        self.rounds = rounds
        self._members = members
        self._chunks = chunks
        self._completeness = completeness
        self._describe = describe
        self._expected_servers = expected_servers

    def start(self, parent: Path) -> Round:
        """A round into a new ``PARENT/ckpt-N``; refused unless every rank is live and every
        chunk is held."""
        ranks = sorted(m.rank for m in self._members.live("server"))
        holders = self._holders()
        if holders is not None:  # embedding slots: the servers that hold something
            if not holders <= set(ranks):
                raise ConflictError(f"live server ranks {ranks}; a checkpoint needs every "
                                    f"server that holds chunks or embedding slots "
                                    f"{sorted(holders)}")
        elif ranks != list(range(self._expected_servers)):
            raise ConflictError(f"live server ranks {ranks}; a checkpoint needs every rank "
                                f"0..{self._expected_servers - 1}")
        missing = self._completeness.missing()
        if missing is not None:
            raise ConflictError(f"a checkpoint needs every chunk; lost: {missing}")
        return self.rounds.start(parent, ranks, self._describe, time.monotonic(),
                                 self._chunks.primaries())

    def tables_placed(self) -> bool:
        """Whether there is anything to save (a table exists)."""
        return bool(self._chunks.tables)

    def _holders(self) -> set[int] | None:
        """With embedding slots (servers added and drained mid-job), the ranks that own a
        dense chunk or a slot, as primary or backup; None in a job without slots, where
        embedding rows are hashed over ranks 0 .. S-1 and every one of them is needed."""
        tables = self._chunks.tables
        if not any(t.slots for t in tables.values()):
            return None
        return {rank for t in tables.values() for c in t.chunks for rank in (c.server, c.backup)
                if rank >= 0}

    def request(self, directory: str) -> Ready:
        """The ``checkpoint`` op: a round into ``directory``, answered once it is written."""
        return self.rounds.waiter(self.start(checkpoint_folder(directory)))

    def tick(self, now: float) -> None:
        """Fail a round past its deadline or with a dead server; start a periodic one."""
        self.rounds.check(now, {m.rank for m in self._members.live("server")})
        directory = self.rounds.directory
        if self.rounds.due(now) and directory is not None and self._chunks.tables:
            try:  # nothing to save before a table exists
                self.start(directory)
            except CheckpointError:  # the folder cannot be made: logged, kept for status
                self.rounds.postpone(now)  # try again one interval later, not on every tick
            except HogshardError as err:
                self.rounds.postpone(now)
                log.warning("periodic checkpoint skipped: %s", err.message)

    def heartbeat(self, rank: int, report: Any) -> dict[str, Any] | None:
        """A server's heartbeat: its report on the round in progress in, and the round it
        still has to write (for the reply's ``checkpoint``) out."""
        self.rounds.report(rank, report)
        return self.rounds.request_for(rank)


@dataclass
class RestoredJob:
    """What a scheduler takes from a checkpoint: its policy, shard map, the lowest worker
    clock, the next membership epoch, and the checkpoint itself (verified)."""

    path: Path
    manifest: dict[str, Any]
    policy: ConsistencyPolicy
    tables: dict[str, PlacedTable]
    clock: int
    epoch: int

    def round(self, describe: Callable[[], Fields]) -> Round:
        """The checkpoint as a complete round, to restore lost servers from."""
        return Round(self.path, set(manifest_ranks(self.manifest)), describe, 0.0,
                     manifest=self.manifest)


def restore_job(path: Path, expected_servers: int) -> RestoredJob:
    """Read the checkpoint at (or ``LATEST`` under) ``path``, every file verified."""
    ckpt = resolve_checkpoint(path)
    manifest = load_manifest(ckpt)
    ranks = manifest_ranks(manifest)
    if len(ranks) != expected_servers:
        raise ConfigError(f"checkpoint {ckpt} was written by {len(ranks)} servers (ranks "
                          f"{ranks}); this job expects {expected_servers} (--servers must "
                          "match: the shard map names server ranks)")
    # a chunk or slot that was moving when the checkpoint was taken is its owner's (the
    # next owner was not asked for it); backups of an unreplicated table are such moves
    tables = {name: PlacedTable(DenseTableSpec(**view["table"]),
                                [Chunk.from_wire(c[:4] if (view.get("replication") or 1) < 2
                                                 else c[:5]) for c in view["chunks"]],
                                ready=True, replication=int(view.get("replication") or 1),
                                slots=int(view.get("slots") or 0))
              for name, view in manifest.get("tables", {}).items()}
    job = RestoredJob(ckpt, manifest, parse_policy(manifest["policy"]), tables,
                      min(manifest.get("clocks", {}).values(), default=0),
                      int(manifest.get("epoch", 0)) + 1)
    log.info("restored %s: tables %s, policy %s, clock %d", ckpt, sorted(tables),
             job.policy.spec, job.clock)
    return job
