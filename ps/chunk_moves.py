"""Dense chunks that leave a drained server (``hogshard embeddings drain``; PROTOCOL.md
section 13.4), on a shard server: the owner's hand-off and the next owner's install.

The scheduler's heartbeat replies list the moves (``chunk_moves``: ``out``, the chunks this
server hands over as ``[table, chunk id, next owner]``; ``in``, those coming to it). From the
moment an owner learns of a move it refuses the chunk (``NOT_OWNER``: workers fetch the map
and retry), applies what a group policy gathered for it, copies its weights, version and
rule state to the next owner (``chunk_handoff``) and reports the copy in its heartbeats
(``handed_chunks``) once acknowledged. The scheduler then names the next owner as the chunk's
server; the old owner drops its copy and keeps refusing the chunk. Every push acknowledged
before the copy is in it; gradients of a step still staged (``partial`` pushes whose step had
not closed) are dropped and counted (``dropped_staged``).

Example (what the shard server does)::

    moves = ChunkMoves(context, security, "server-0", rank=0)
    moves.adopt(reply.header, store)        # from a heartbeat reply
    moves.check("push", message)            # NotOwnerError for a chunk that is moving
    moves.step(now, store, before=settle)   # copy what is due; True: report it now
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from hogshard.proto.errors import ConflictError, NotOwnerError, ProtocolError
from hogshard.proto.ops import Field
from hogshard.proto.security import Security
from hogshard.proto.transport import ERROR, connect_dealer, request_header, send
from hogshard.proto.wire import Message, decode
from hogshard.ps.dense import FLOAT32, DenseChunk, DenseStore, DenseTable

log = logging.getLogger(__name__)

Key = tuple[str, int]
#: Seconds before a copy the next owner refused (it has not heard of the move yet) goes again.
RETRY_S = 0.2


@dataclass
class _Link:
    rank: int
    address: str
    socket: zmq.Socket
    sent: int = 0


class ChunkMoves:
    """The dense chunks moving out of (and into) one server."""

    def __init__(self, context: zmq.Context, security: Security | None, sender: str,
                 rank: int) -> None:
        self._context = context
        self._security = security
        self.sender = sender
        self.rank = rank
        self.out: dict[Key, int] = {}  # chunk -> next owner
        self.incoming: dict[Key, int] = {}  # chunk -> its owner
        self.gone: set[Key] = set()  # handed over and dropped
        self._pending: dict[Key, float] = {}  # to copy, not before this monotonic time
        self._sent: dict[int, tuple[int, list[Key]]] = {}  # link rank -> (seq, chunks)
        self._acked: set[Key] = set()
        self._links: dict[int, _Link] = {}
        self._addresses: dict[int, str] = {}
        self._watched: set[zmq.Socket] = set()
        self._closed: list[zmq.Socket] = []  # replaced links, closed once unwatched
        self.reported = 0  # hand-offs acknowledged at the last look (a new one: heartbeat now)
        self.moved: dict[str, float] = {"chunks_out": 0, "bytes_out": 0, "chunks_in": 0,
                                         "bytes_in": 0, "dropped_staged": 0}

    @property
    def active(self) -> bool:
        return bool(self.out or self.gone)

    def adopt(self, reply: Message, store: DenseStore) -> None:
        """Take the moves a heartbeat reply lists (``chunk_moves``, ``servers``)."""
        moves, servers = reply.get("chunk_moves"), reply.get("servers")
        if not isinstance(moves, dict):
            return
        if isinstance(servers, dict):
            self._addresses = {int(r): str(a) for r, a in servers.items()}
        out = {(str(t), int(c)): int(to) for t, c, to in moves.get("out", [])}
        self.incoming = {(str(t), int(c)): int(frm) for t, c, frm in moves.get("in", [])}
        for key in set(self.out) - set(out):
            if key in self._acked:  # handed over: the map names the next owner now
                table = store.tables.get(key[0])
                if table is not None:
                    table.chunks.pop(key[1], None)
                self.gone.add(key)
                self.moved["chunks_out"] += 1
            self._acked.discard(key)
            self._pending.pop(key, None)
        for key, target in out.items():
            if self.out.get(key) != target:
                self._pending[key] = 0.0
                self._acked.discard(key)
        self.out = out
        targets = set(out.values())
        self._sent = {r: sent for r, sent in self._sent.items() if r in targets}
        if out or self.gone:
            log.info("%s: %d dense chunks moving out, %d in", self.sender, len(out),
                     len(self.incoming))

    def check(self, op: str, msg: Message) -> None:
        """Raise NotOwnerError if a ``push`` or ``pull`` names a chunk that is moving or gone."""
        if op not in ("push", "pull") or not self.active:
            return
        table, chunks = msg.get("table"), msg.get("chunks")
        if not isinstance(chunks, list):
            return
        for chunk in chunks:
            key = (table, chunk)
            if key in self.out or key in self.gone:
                where = "is moving to" if key in self.out else "moved to"
                raise NotOwnerError(
                    f"{self.sender}: chunk {chunk} of table {table!r} {where} another server; "
                    "fetch the shard map and retry")

    # ---- the owner --------------------------------------------------------------------------

    def due(self, now: float) -> bool:
        return any(t <= now for t in self._pending.values())

    def step(self, now: float, store: DenseStore,
             before: Callable[[list[Key]], None]) -> bool:
        """Copy what is due (:meth:`send`); True when a next owner acknowledged chunks since
        the last step (the heartbeat that reports them should go at once)."""
        if self.due(now):
            self.send(store, before)
        reported = len(self.report())
        more, self.reported = reported > self.reported, reported
        return more

    def send(self, store: DenseStore, before: Callable[[list[Key]], None]) -> None:
        """Copy the chunks due to their next owners, one ``chunk_handoff`` each; ``before``
        settles the chunks first (updates in flight, groups gathered, steps staged)."""
        now = time.monotonic()
        due = sorted(k for k, t in self._pending.items() if t <= now)
        by_target: dict[int, list[Key]] = {}
        for key in due:
            target = self.out.get(key)
            if target is None or target not in self._addresses:
                continue
            if target in self._sent:  # one copy in flight per next owner
                continue
            by_target.setdefault(target, []).append(key)
        if not by_target:
            return
        before([k for keys in by_target.values() for k in keys])
        for target, keys in by_target.items():
            fields, arrays, sent = _handoff(store, keys)
            for key in keys:
                self._pending.pop(key, None)
            if not sent:
                continue
            link = self._link(target)
            link.sent += 1
            header = request_header("chunk_handoff", link.sent, self.sender,
                                    rank=self.rank, **fields)
            send(link.socket, header, arrays)
            self._sent[target] = (link.sent, sent)
            self.moved["bytes_out"] += sum(int(a.nbytes) for a in arrays)
            log.info("%s: %d dense chunks copied to server %d", self.sender, len(sent), target)

    def _link(self, rank: int) -> _Link:
        link = self._links.get(rank)
        address = self._addresses[rank]
        if link is None or link.address != address:
            if link is not None:
                self._closed.append(link.socket)
            link = self._links[rank] = _Link(rank, address, connect_dealer(
                self._context, address, security=self._security))
        return link

    def watch(self, poller: zmq.Poller) -> None:
        """Keep ``poller`` watching the links to next owners."""
        current = {link.socket for link in self._links.values()}
        for sock in self._watched - current:
            poller.unregister(sock)
        for sock in self._closed:
            sock.close(0)
        self._closed.clear()
        for sock in current - self._watched:
            poller.register(sock, zmq.POLLIN)
        self._watched = current

    def read(self, events: dict[Any, int]) -> None:
        """Take the next owners' acknowledgements (a refusal sends the copy again later)."""
        for link in list(self._links.values()):
            if link.socket not in events:
                continue
            while link.socket.poll(0, zmq.POLLIN):
                message = decode(link.socket.recv_multipart(copy=False))
                seq, keys = self._sent.get(link.rank, (-1, []))
                if message.request_id != seq:
                    continue
                del self._sent[link.rank]
                if message.op == ERROR:
                    log.info("%s: server %d refused dense chunks (%s); sending again",
                             self.sender, link.rank, message.get("message"))
                    retry = time.monotonic() + RETRY_S
                    self._pending.update({k: retry for k in keys if k in self.out})
                else:
                    self._acked.update(k for k in keys if self.out.get(k) == link.rank)

    def report(self) -> list[list[Any]]:
        """``[[table, chunk id, next owner], ...]`` acknowledged (heartbeat ``handed_chunks``)."""
        return [[t, c, self.out[(t, c)]] for t, c in sorted(self._acked) if (t, c) in self.out]

    def handed(self) -> set[Key]:
        """Chunks whose copy the next owner acknowledged (it holds them whole; a restarted
        scheduler learns them from it, not from this server)."""
        return {key for key in self._acked if key in self.out} | self.gone

    def reset(self) -> None:
        """Registered again (a restarted scheduler, or this server declared dead): the moves
        are off, and a chunk still held here is served again if the map names this server
        (a scheduler that declared it dead called its moves off; a restarted one placed each
        chunk where a server reported it: here, unless the next owner acknowledged a copy)."""
        self.out, self.incoming, self._pending, self._sent = {}, {}, {}, {}
        self._acked.clear()
        self.reported = 0

    # ---- the next owner ---------------------------------------------------------------------

    def install(self, store: DenseStore, msg: Message) -> tuple[dict[str, Any], list[Any]]:
        """``chunk_handoff``: install the chunks sent (``tables``: each table's rule and size;
        ``chunks``: ``[table, id, offset, length, version, state_keys, scalars]``; the arrays
        are each chunk's weights and state arrays by key). NOT_OWNER until this server has
        heard of the move."""
        entries, specs, sender = msg.header["chunks"], msg.header["tables"], msg.header["rank"]
        if not all(isinstance(e, list) and len(e) == 7 for e in entries):
            raise ProtocolError("'chunk_handoff': field 'chunks' must list [table, id, offset, "
                                "length, version, state_keys, scalars] entries")
        for entry in entries:
            if self.incoming.get((entry[0], entry[1])) != sender:
                raise NotOwnerError(f"{self.sender} does not expect chunk {entry[1]} of table "
                                    f"{entry[0]!r} from server {sender} (yet)")
        arrays = list(msg.arrays)
        fresh: list[tuple[DenseTable, DenseChunk]] = []
        tables: dict[str, DenseTable] = {}
        for name, chunk_id, offset, length, version, keys, scalars in entries:
            spec = specs.get(name) if isinstance(specs, dict) else None
            if not isinstance(spec, dict) or not isinstance(spec.get("rule"), dict):
                raise ProtocolError(f"'chunk_handoff': no rule for table {name!r}")
            table = tables.get(name) or store.tables.get(name)
            if table is not None and table.rule_spec != spec["rule"]:
                raise ConflictError(f"table {name!r} exists here with rule {table.rule_spec}; "
                                    f"server {sender} has {spec['rule']}")
            table = tables[name] = table or DenseTable.from_spec(name, dict(spec["rule"]))
            weights = np.array(arrays.pop(0), dtype=FLOAT32, copy=True)
            if weights.shape != (length,):
                raise ProtocolError(f"chunk {chunk_id} of {name!r}: {weights.shape} weights; "
                                    f"expected ({length},)")
            state = table.rules.registered_for(offset).new_state(length)
            for key in keys:
                state[key] = np.array(arrays.pop(0), dtype=FLOAT32, copy=True)
            state.update(scalars)
            fresh.append((table, DenseChunk(chunk_id, offset, weights, state, int(version))))
        if arrays:
            raise ProtocolError(f"'chunk_handoff': {len(arrays)} arrays left over")
        for name, table in tables.items():
            store.tables.setdefault(name, table)
            size = specs[name].get("size")
            if isinstance(size, list) and len(size) == 2:
                store.sizes.setdefault(name, (int(size[0]), int(size[1])))
        for table, chunk in fresh:
            store.tables[table.name].chunks[chunk.chunk_id] = chunk
            self.gone.discard((table.name, chunk.chunk_id))
        self.moved["chunks_in"] += len(fresh)
        self.moved["bytes_in"] += sum(int(a.nbytes) for a in msg.arrays)
        return {"chunks": len(fresh)}, []

    def close(self) -> None:
        for link in self._links.values():
            link.socket.close(0)
        self._links.clear()


def _handoff(store: DenseStore, keys: list[Key]
             ) -> tuple[dict[str, Any], list[np.ndarray], list[Key]]:
    """The fields and arrays of a ``chunk_handoff`` of ``keys`` (those held here)."""
    entries, arrays, specs, sent = [], [], {}, []
    for name, chunk_id in keys:
        table = store.tables.get(name)
        chunk = table.chunks.get(chunk_id) if table is not None else None
        if table is None or chunk is None:
            log.error("dense chunk %d of table %r must move but is not held here", chunk_id,
                      name)
            continue
        state_keys = sorted(k for k, v in chunk.state.items() if isinstance(v, np.ndarray))
        scalars = {k: v for k, v in chunk.state.items() if not isinstance(v, np.ndarray)}
        entries.append([name, chunk_id, chunk.offset, int(chunk.weights.size), chunk.version,
                        state_keys, scalars])
        arrays.extend([chunk.weights.copy(), *(chunk.state[k].copy() for k in state_keys)])
        size = store.sizes.get(name)
        specs[name] = {"rule": table.rule_spec, **({"size": list(size)} if size else {})}
        sent.append((name, chunk_id))
    return {"tables": specs, "chunks": entries}, arrays, sent


#: The header of ``chunk_handoff`` (checked by the service core before the handler runs).
FIELDS = {
    "chunk_handoff": (Field("rank", int, required=True), Field("tables", dict, required=True),
                      Field("chunks", list, required=True)),
}
