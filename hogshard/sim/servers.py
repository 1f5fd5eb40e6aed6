"""A simulated shard server: the real dense store, update applier and policy gate, behind one
FIFO queue whose service times come from the network model.

A server does one message at a time, as a real one does on its loop: a push is applied (or
joins its softsync/hardsync group) by ``UpdateApplier``, a pull is answered when the policy
allows it and otherwise held until a later push or a learner's leaving releases it. Given a
shared ``Host``, its message work takes the host's cores like the learners' compute, and the
messages waiting meanwhile are served one per learner in turn, as a ZeroMQ ROUTER
fair-queues its peers.

Example::

    server = VirtualServer(0, policy, {"rule": "sgd", "lr": 0.1}, chunks, weights, loop, net)
    server.receive_step("learner-0", grads, versions, clock=1, reply=on_weights)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hogshard.proto.clock_gate import ClockGate
from hogshard.proto.errors import HogshardError
from hogshard.proto.held import HeldRequests
from hogshard.proto.policy import ConsistencyPolicy
from hogshard.proto.tables import Chunk
from hogshard.ps.applier import UpdateApplier
from hogshard.ps.dense import DenseStore
from hogshard.ps.stats import ServerStats, summarise_histogram
from hogshard.sim.events import EventLoop
from hogshard.sim.host import Host
from hogshard.sim.timing import NetworkModel

TABLE = "model"
#: (chunk weights copies, their versions) for the chunks this server holds, in its order.
Reply = Callable[[list[np.ndarray], list[int]], None]


@dataclass
class _Job:
    arrived: float
    nbytes: int
    run: Callable[[], None]
    #: The learner whose message this is ("": the server's own reply work).
    peer: str = ""


@dataclass
class QueueStats:
    """What a server's queue saw: messages, time busy, waits before service."""

    messages: int = 0
    busy_s: float = 0.0
    max_length: int = 0
    waits_us: list[int] = field(default_factory=list)

    def summary(self, elapsed_s: float) -> dict[str, Any]:
        waits = summarise_histogram(_counts(self.waits_us))
        return {"messages": self.messages, "busy_s": self.busy_s,
                "utilisation": self.busy_s / elapsed_s if elapsed_s > 0 else 0.0,
                "max_queue_length": self.max_length,
                "queue_wait_ms": {"mean": waits["mean"] / 1000, "p50": waits["p50"] / 1000,
                                  "p99": waits["p99"] / 1000, "max": waits["max"] / 1000}}


def _counts(values: list[int]) -> dict[int, int]:
    found, counts = np.unique(np.asarray(values, dtype=np.int64), return_counts=True)
    return {int(v): int(c) for v, c in zip(found, counts, strict=True)}


class VirtualServer:
    """One shard: ``chunks`` of the model (placed on this rank) and their update rule."""

    def __init__(self, rank: int, policy: ConsistencyPolicy, rule_spec: dict[str, Any],
                 chunks: Sequence[Chunk], weights: np.ndarray, loop: EventLoop,
                 network: NetworkModel, learners: Sequence[str],
                 bytes_per_element: float = 4.0, host: Host | None = None) -> None:
        self.rank = rank
        self.policy = policy
        self.loop = loop
        self.network = network
        self.chunks = list(chunks)
        self.ids = [c.chunk_id for c in self.chunks]
        self.nbytes = int(bytes_per_element * sum(c.length for c in self.chunks))
        self.store = DenseStore()
        self.store.init(TABLE, rule_spec, [(c.chunk_id, c.offset, c.length) for c in chunks],
                        [weights[c.offset:c.offset + c.length].copy() for c in chunks])
        self.stats = ServerStats()
        self.applier = UpdateApplier(policy, self.stats)
        self.queue_stats = QueueStats()
        self.live: set[str] = set(learners)
        self.refused = 0
        #: Steps finished by each live learner: what the policy gate reads, kept as it changes.
        self._clocks = ClockGate()
        self._clocks.restore(dict.fromkeys(self.live, 0))
        self._queue: deque[_Job] = deque()
        #: On a shared host: its message work runs on the host's cores, and waiting messages
        #: are taken one per learner in turn (a ZeroMQ ROUTER's fair queueing), replies first.
        self.host = host
        self._peers: dict[str, deque[_Job]] = {}
        self._turns: deque[str] = deque()
        self._queued = 0
        self._busy = False
        self._deferred = HeldRequests[tuple[str, int, Reply]](per_peer=None, total=None)

    # ---- the queue ----------------------------------------------------------------------------

    def _enqueue(self, job: _Job, front: bool = False) -> None:
        if front:
            self._queue.appendleft(job)
        elif self.host is not None:
            waiting = self._peers.setdefault(job.peer, deque())
            if not waiting:
                self._turns.append(job.peer)
            waiting.append(job)
            self._queued += 1
        else:
            self._queue.append(job)
        self.queue_stats.max_length = max(self.queue_stats.max_length,
                                          len(self._queue) + self._queued)
        if not self._busy:
            self._next()

    def _take(self) -> _Job | None:
        if self._queue:
            return self._queue.popleft()
        if not self._turns:
            return None
        peer = self._turns.popleft()
        waiting = self._peers[peer]
        job = waiting.popleft()
        self._queued -= 1
        if waiting:
            self._turns.append(peer)
        return job

    def _next(self) -> None:
        job = self._take()
        if job is None:
            self._busy = False
            return
        self._busy = True
        service = self.network.service(job.nbytes)
        stats = self.queue_stats
        stats.messages += 1
        stats.busy_s += service
        stats.waits_us.append(int(round((self.loop.now - job.arrived) * 1e6)))

        def done() -> None:
            job.run()
            self._next()

        if self.host is None:
            self.loop.after(service, done)
        else:
            self.host.compute(service, done)

    # ---- messages -----------------------------------------------------------------------------

    def receive_step(self, learner: str, grads: list[np.ndarray] | None, versions: list[int],
                     clock: int, reply: Reply | None) -> None:
        """A learner's step as it leaves the learner: its push (``grads`` for this server's
        chunks, computed at ``versions``) then, on the same connection, its pull for ``clock``
        (``reply`` None: no pull). Both reach the server after the network's transfer time."""
        nbytes = self.nbytes if grads is not None else 0
        arrive = self.network.transfer(nbytes)

        def arrived() -> None:
            now = self.loop.now
            if grads is not None:
                self._enqueue(_Job(now, nbytes, lambda: self._push(learner, grads, versions,
                                                                   clock), learner))
            if reply is not None:
                self._enqueue(_Job(now, 0, lambda: self._pull(learner, clock, reply), learner))

        self.loop.after(arrive, arrived)

    def _push(self, learner: str, grads: list[np.ndarray], versions: list[int],
              clock: int) -> None:
        try:
            table, chunks = self.store.validate_push(TABLE, self.ids, grads, versions)
            self.applier.push(table, chunks, grads, versions, learner, self.live)
        except HogshardError:
            self.refused += 1  # a real server answers ERROR (e.g. a NaN gradient)
            return
        self.stats.pushes += 1
        self.stats.bytes_in += self.nbytes
        self._clocks.advance(learner, clock)
        self._release()

    def _allowed(self, learner: str, clock: int) -> bool:
        if self.applier.waiting_on(learner, TABLE, self.ids):
            return False
        if learner in self.live:  # a learner with no clock joins at the slowest live clock
            self._clocks.advance(learner, self._clocks.admit(self.policy, learner, clock))
        return self._clocks.may_pull(self.policy, learner, clock)

    def _pull(self, learner: str, clock: int, reply: Reply) -> None:
        self.stats.pulls += 1
        if self._allowed(learner, clock):
            self._answer(reply)
        else:
            self.stats.deferred_pulls += 1
            self._deferred.hold(learner.encode(), (learner, clock, reply))

    def _answer(self, reply: Reply) -> None:
        """Copy the weights into a reply: the copying takes server time (a job at the front of
        the queue) and the reply then crosses the network."""
        def send() -> None:
            table = self.store.table(TABLE)
            chunks = [table.chunks[i] for i in self.ids]
            weights = [c.weights.copy() for c in chunks]
            versions = [c.version for c in chunks]
            self.stats.bytes_out += self.nbytes
            self.loop.after(self.network.transfer(self.nbytes), lambda: reply(weights, versions))

        self._enqueue(_Job(self.loop.now, self.nbytes, send), front=True)

    def _release(self) -> None:
        """Answer the held pulls the policy now allows, in the order they came."""
        allowed: list[Reply] = []

        def settle(pull: tuple[str, int, Reply]) -> bool:
            learner, clock, reply = pull
            if not self._allowed(learner, clock):
                return False
            allowed.append(reply)
            return True

        self._deferred.release(settle)
        for reply in reversed(allowed):  # each goes to the front: the first ends up first
            self._answer(reply)

    def leave(self, learner: str) -> None:
        """A learner finished: it leaves lambda and the clock minimum, open groups complete."""
        self.live.discard(learner)
        self._clocks.forget(learner)
        self.applier.complete_groups(self.live)
        self._release()

    # ---- reading ------------------------------------------------------------------------------

    def weights_into(self, flat: np.ndarray) -> None:
        """Write this server's chunks into the model's flat vector."""
        table = self.store.table(TABLE)
        for c in self.chunks:
            flat[c.offset:c.offset + c.length] = table.chunks[c.chunk_id].weights

    def summary(self, elapsed_s: float) -> dict[str, Any]:
        return {"rank": self.rank, "pushes": self.stats.pushes, "pulls": self.stats.pulls,
                "updates": self.stats.updates, "deferred_pulls": self.stats.deferred_pulls,
                "refused": self.refused, "bytes_in": self.stats.bytes_in,
                "bytes_out": self.stats.bytes_out, **self.queue_stats.summary(elapsed_s)}
