"""The shard server's dense ``pull`` (PROTOCOL.md), as :class:`DensePulls`: answered with the
live weights at once (no copy: the next update of a chunk whose reply is still leaving copies
first, ``DenseChunk.writable``), or held while the consistency policy holds it back and
answered by :meth:`DensePulls.release` once it allows it. Part of the dense ops
(ps/dense_ops.py), which release the held pulls whenever a push or the workers move a clock.

Example (what ``DenseOps`` does)::

    pulls = DensePulls(store, applier, view, updates, replicas, stats, replies, heartbeats,
                       rank=0, shm=shm, held=HeldRequests(64, 4096))
    pulls.pull(Request(identity, message))      # HELD: answered through ``replies``
    pulls.release()                             # after a push: answer what the policy allows
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hogshard.proto.codecs import Codec
from hogshard.proto.codecs.pull import pull_codec
from hogshard.proto.errors import HogshardError
from hogshard.proto.held import MAX_HELD, HeldRequests
from hogshard.proto.requests import HELD, Request, Result
from hogshard.proto.service import Replies
from hogshard.proto.transport import COPY_BELOW
from hogshard.proto.wire import Message
from hogshard.ps.applier import UpdateApplier
from hogshard.ps.dense import DenseChunk, DenseStore, DenseTable, encoded_weights
from hogshard.ps.executor import UpdateExecutor
from hogshard.ps.replication import Replicator
from hogshard.ps.shm_plane import ShmPlane
from hogshard.ps.stats import ServerStats
from hogshard.ps.workers import WorkerView

log = logging.getLogger(__name__)


class Hurry(Protocol):
    """What a pull asks of the scheduler link: learn the workers sooner."""

    def hurry(self) -> None: ...


@dataclass
class DeferredPull:
    """A pull the policy holds back: the connection it came on and its message."""

    identity: bytes
    message: Message


class DensePulls:
    """The dense tables' pulls of one shard server, and those the policy holds back
    (``held``: bounded per connection and in all)."""

    def __init__(self, store: DenseStore, applier: UpdateApplier, view: WorkerView,
                 updates: UpdateExecutor, replicas: Replicator, stats: ServerStats,
                 replies: Replies, heartbeats: Hurry, rank: int, shm: ShmPlane,
                 held: HeldRequests[DeferredPull]) -> None:
        self._store = store
        self._applier = applier
        self._view = view
        self._updates = updates
        self._replicas = replicas
        self._stats = stats
        self._replies = replies
        self._heartbeats = heartbeats
        self._rank = rank
        self.shm = shm
        self._held = held
        #: Pulls whose sender was admitted at a higher clock: (identity, request id) -> clock.
        self._admitted: dict[tuple[bytes, int], int] = {}

    def __len__(self) -> int:
        """Pulls the policy holds back now."""
        return len(self._held)

    def pull(self, request: Request) -> Result:
        """Answered with the weights, at once or once the policy allows it (HELD)."""
        identity, msg = request.identity, request.message
        clock, sender = msg.get("clock"), str(msg.get("from"))
        if clock is not None and not self._view.note(sender, time.monotonic()):
            self._heartbeats.hurry()
        table, chunks = self._store.resolve(msg.get("table"), msg.get("chunks"))
        codec = pull_codec(msg.get("codec"))
        if self._replicas.replicated(table.name):
            self._replicas.check_primary(table.name, [c.chunk_id for c in chunks],
                                         time.monotonic(), self._rank)
        if clock is not None and self._clocked_pull(identity, msg, sender, clock):
            self.release()
        if not self._may_pull(msg):
            refused = self._held.refusal(identity, "pulls of this connection")
            if refused is not None:
                raise refused
            self._stats.deferred_pulls += 1
            self._held.hold(identity, DeferredPull(identity, msg))
            return HELD
        self._send_pull(identity, msg, table, chunks, codec)
        return HELD

    def _clocked_pull(self, identity: bytes, msg: Message, sender: str, clock: int) -> bool:
        """Take a pull's clock; True if it moved the sender's clock. A joiner admitted at a
        higher clock (WorkerView.admit) is told so in the reply's ``clock``."""
        admitted, moved = self._view.admit(self._applier.policy, sender, clock)
        if admitted > clock:
            if len(self._admitted) >= (self._held.total or MAX_HELD):
                self._admitted.clear()
            self._admitted[(identity, msg.request_id)] = admitted
            log.info("%s joins at clock %d (it asked for %d)", sender, admitted, clock)
        return moved

    def _may_pull(self, msg: Message) -> bool:
        sender = str(msg.get("from"))
        if self._applier.waiting_on(sender, msg.get("table"), msg.get("chunks")):
            return False
        return self._view.may_pull(self._applier.policy, sender, msg.get("clock"))

    def _send_pull(self, identity: bytes, msg: Message, table: DenseTable,
                   chunks: list[DenseChunk], codec: Codec | None) -> None:
        """Reply to a pull with the chunks' live weights, without a copy (unless updates of
        them are queued: then with copies read after those)."""
        if self._updates.read_for_pull(
                identity, msg.request_id, table, chunks,
                lambda copies, versions: self._answer_pull(
                    identity, msg, table, chunks, codec, copies, versions)):
            return
        live = not self._applier.policy.modifiers.dc_lambda  # +dc: the applier keeps what was read
        arrays = [chunk.weights if live else chunk.weights.copy() for chunk in chunks]
        # frames below COPY_BELOW are copied as they are sent: only larger ones need a tracker
        track = live and any(chunk.weights.nbytes >= COPY_BELOW for chunk in chunks)
        tracker = self._answer_pull(identity, msg, table, chunks, codec, arrays,
                                    [chunk.version for chunk in chunks], track=track)
        if track:
            for chunk in chunks:
                chunk.in_flight = tracker

    def _answer_pull(self, identity: bytes, msg: Message, table: DenseTable,
                     chunks: Sequence[DenseChunk], codec: Codec | None,
                     arrays: list[np.ndarray], versions: list[int], track: bool = False) -> Any:
        """Send a pull's reply; ``arrays`` must be copies unless ``track``."""
        if self._applier.policy.modifiers.dc_lambda:
            for chunk, array in zip(chunks, arrays, strict=True):
                self._applier.remember_pull(str(msg.get("from")), table.name, chunk.chunk_id,
                                            array)
        fields: dict[str, Any] = {"versions": versions}
        admitted = self._admitted.pop((identity, msg.request_id), None)
        if admitted is not None:
            fields["clock"] = admitted
        sent = arrays
        if codec is not None:  # new arrays: nothing of the live weights leaves
            arrays, track, fields["codec"] = encoded_weights(codec, chunks, arrays, versions), False, \
                codec.name
            sent = arrays
        elif type(msg.get("shm")) is int and not self._applier.policy.modifiers.dc_lambda:
            shm, arrays = self.shm.publish(table, chunks, arrays, versions,
                                           max(4, msg.get("shm")))
            if len(arrays) < len(chunks):
                fields["shm"] = shm
                self._stats.shm_bytes_out += sum(a.nbytes for a in sent) - \
                    sum(a.nbytes for a in arrays)
        tracker = self._replies.reply(identity, msg.request_id, fields, arrays, track=track)
        self._stats.pulls += 1
        self._stats.bytes_out += sum(a.nbytes for a in sent)
        return tracker

    def release(self) -> None:
        """Answer the held pulls the policy now allows (their tables are looked up again:
        they may have been replaced while the pulls waited)."""
        self._held.release(self._answer_held)

    def _answer_held(self, pull: DeferredPull) -> bool:
        if not self._may_pull(pull.message):
            return False
        msg = pull.message
        try:
            table, chunks = self._store.resolve(msg.get("table"), msg.get("chunks"))
            self._send_pull(pull.identity, msg, table, chunks, pull_codec(msg.get("codec")))
        except HogshardError as err:
            self._replies.fail(pull.identity, msg.request_id, err)
        return True
