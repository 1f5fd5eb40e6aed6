"""Replies a replicated primary holds back (PROTOCOL.md sections 11 and 16), and those of pushes
whose gradients wait in a group (``softsync:N``, ``hardsync``).

A push to a replicated table is answered only once the chunk's backup holds what it applied:
its reply is a :class:`HeldReply` waiting for the backups' acknowledgements of the ``replicate``
messages that carried its updates. Under a group policy a push's gradient may join a chunk's
open group instead of being applied: the push is then a :class:`Contribution` whose reply waits
until each group it joined has been applied and forwarded (the group's ``replicate`` record
lists every contributor's push id), and only then becomes a held reply like any other. So an
acknowledged gradient is always in the backup's weights, and a push whose group died with its
primary is never acknowledged: the worker sends it again to the new primary, where it joins a
new group. A push sent again while its first copy still waits in a group (same push id) is
answered after that copy (it follows it).

Example::

    replies = GroupReplies()
    push = replies.start(b"worker", request_id=4, push_id=99, table="model")
    push.open = {0}                                  # its gradient of chunk 0 joined a group
    replies.own_forwarded(push, {"staleness": [0]}, needs={})     # [] (chunk 0 still open)
    ready = replies.group_forwarded([update_of_chunk_0], [{1: 7}])  # the group applied
    # ready == [HeldReply(b"worker", 4, {"staleness": [0]}, needs={1: 7})]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hogshard.ps.update_pool import AppliedUpdate


@dataclass
class HeldReply:
    """A worker's push reply waiting until each backup in ``needs`` acknowledged a sequence."""

    identity: bytes
    request_id: int
    fields: dict[str, Any]
    needs: dict[int, int] = field(default_factory=dict)  # backup rank -> sequence number


@dataclass(eq=False)
class Contribution:
    """A replicated push on its way to a reply: ``open`` lists the chunks (of ``table``)
    whose group holds its gradient, not yet applied and forwarded; ``forwarded`` says its own
    forward (the updates its ticket made) has left; ``after``: the first copy of this push,
    still waiting, that it follows."""

    push_id: int | None
    table: str
    reply: HeldReply
    open: set[int] = field(default_factory=set)
    forwarded: bool = False
    after: Contribution | None = None
    followers: list[Contribution] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.forwarded and not self.open and (self.after is None or self.after.done)


def _merge(needs: dict[int, int], more: dict[int, int]) -> None:
    for rank, seq in more.items():
        needs[rank] = max(needs.get(rank, 0), seq)


class GroupReplies:
    """The contributions of one primary not yet answerable, in start order."""

    def __init__(self) -> None:
        self._waiting: dict[int, Contribution] = {}  # by id()
        self._by_push: dict[int, Contribution] = {}  # push id -> its first copy still waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def start(self, identity: bytes, request_id: int, push_id: int | None,
              table: str) -> Contribution:
        """A push about to be applied; its reply waits here until :meth:`own_forwarded`."""
        contribution = Contribution(push_id, table, HeldReply(identity, request_id, {}))
        self._waiting[id(contribution)] = contribution
        if push_id is not None:
            first = self._by_push.setdefault(push_id, contribution)
            if first is not contribution:  # sent again while the first copy waits
                contribution.after = first
                first.followers.append(contribution)
        return contribution

    def cancel(self, contribution: Contribution) -> None:
        """A push that failed before any of it was applied (its error is its reply)."""
        self._forget(contribution)
        for follower in contribution.followers:
            follower.after = None

    def own_forwarded(self, contribution: Contribution, fields: dict[str, Any],
                      needs: dict[int, int]) -> list[HeldReply]:
        """The push's own updates were forwarded (``needs``: to which backups, up to which
        sequence); its reply will say ``fields``. Returns the replies now to hold."""
        contribution.reply.fields = fields
        _merge(contribution.reply.needs, needs)
        contribution.forwarded = True
        return self._settle([contribution])

    def group_forwarded(self, applied: Sequence[AppliedUpdate],
                        needs: Sequence[dict[int, int]]) -> list[HeldReply]:
        """Updates were forwarded, ``needs[i]`` for ``applied[i]``: the contributions to a
        group update among them no longer wait for it. Returns the replies now to hold."""
        touched: list[Contribution] = []
        for update, update_needs in zip(applied, needs, strict=True):
            for tag in update.tags:
                if isinstance(tag, Contribution) and id(tag) in self._waiting:
                    tag.open.discard(update.chunk.chunk_id)
                    _merge(tag.reply.needs, update_needs)
                    touched.append(tag)
        return self._settle(touched)

    def drop(self) -> list[HeldReply]:
        """Forget every contribution (the server lost its roles); returns their replies."""
        replies = [c.reply for c in self._waiting.values()]
        self._waiting.clear()
        self._by_push.clear()
        return replies

    def replies(self) -> Iterator[HeldReply]:
        """The replies still waiting here (their ``needs`` so far)."""
        return (c.reply for c in self._waiting.values())

    def _settle(self, candidates: list[Contribution]) -> list[HeldReply]:
        ready: list[HeldReply] = []
        for contribution in candidates:
            if id(contribution) in self._waiting and contribution.done:
                self._finish(contribution, ready)
        return ready

    def _finish(self, contribution: Contribution, ready: list[HeldReply]) -> None:
        self._forget(contribution)
        ready.append(contribution.reply)
        for follower in contribution.followers:
            _merge(follower.reply.needs, contribution.reply.needs)
            if id(follower) in self._waiting and follower.done:
                self._finish(follower, ready)

    def _forget(self, contribution: Contribution) -> None:
        self._waiting.pop(id(contribution), None)
        if contribution.push_id is not None and \
                self._by_push.get(contribution.push_id) is contribution:
            del self._by_push[contribution.push_id]
