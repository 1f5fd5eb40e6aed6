"""Applying pushed gradients to chunks as the consistency policy says.

Per gradient: its staleness (the chunk's version now minus the version the worker pulled) is
measured, ``+maxstale`` may drop it, ``+dc`` compensates it, ``+lr=staleness`` scales it (while
fewer workers are live than the most the policy has seen, by no more than the running mean
staleness allows), or ``+lr=mean``, by the running mean staleness of the gradients taken since
the policy began, to the power of the update rule's law (1 for sgd and momentum, 0.5 for the
adaptive rules: ``mean_rate_power``). Then
either the update rule applies it at once (a group of one) or it joins the chunk's pending group,
whose mean is applied when the group is complete (softsync: c gradients; hardsync: one from
every live worker). The version does not move while a group fills, so staleness measured on
arrival equals staleness at apply time.

A modifier's factor scales the rule's step. In a group the factors weight the gradients'
mean and their mean scales the group's step (for sgd: the sum of each factor times its
gradient, over the group's size, as if each were applied alone at its factor). A short group
(fewer gradients than the largest group this policy has formed, as learners leave at the end
of a job or mid-job) moves the weights by its size over that full size: each gradient moves
the weights as far as it would in a full group, so a job's tail never takes full steps on a
few gradients (docs/POLICIES.md, "Run ends").

Example::

    applier = UpdateApplier(parse_policy("softsync:2"), stats)
    staleness = applier.push(table, chunks, grads, versions, sender="worker-0", live={...})
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from hogshard.proto.errors import ConflictError
from hogshard.proto.policy import ConsistencyPolicy, mean_rate_power, rate_rule_note
from hogshard.ps.dense import DenseChunk, DenseTable
from hogshard.ps.executor import InlineUpdates, UpdateRunner
from hogshard.ps.rules import UpdateRule
from hogshard.ps.stats import ServerStats
from hogshard.ps.update_pool import Ticket

log = logging.getLogger(__name__)

#: The (policy, rule) pairs whose ``+lr=mean`` law this process has logged (once, however many
#: appliers: the simulator runs several servers in one process).
_NOTED: set[tuple[str, str]] = set()


@dataclass
class _Group:
    """Gradients gathered for a chunk's next update."""

    total: np.ndarray | None = None
    contributors: list[str] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    #: Sum of the contributors' modifier factors.
    scale: float = 0.0
    #: The rule the group is applied with: that of its latest gradient's push.
    rule: UpdateRule | None = None
    #: The contributors' tags (pushes that passed one), recorded with the group's update.
    tags: list[object] = field(default_factory=list)


class UpdateApplier:
    """The policy-dependent half of a push (the store validates and holds the data)."""

    def __init__(self, policy: ConsistencyPolicy, stats: ServerStats,
                 updates: UpdateRunner | None = None) -> None:
        self.policy = policy
        self.stats = stats
        #: Runs each update and moves the chunk's version (inline by default; ps/executor.py).
        self.updates: UpdateRunner = updates if updates is not None else InlineUpdates(stats)
        self._groups: dict[tuple[str, int], _Group] = {}
        self._chunks: dict[tuple[str, int], tuple[DenseTable, DenseChunk]] = {}
        self._pulled: dict[tuple[str, str, int], np.ndarray] = {}
        #: Sum and count of the staleness of the gradients taken under this policy (+lr=mean).
        self._staleness_sum = 0
        self._staleness_count = 0
        #: The largest group this policy has formed (c at full strength): a short group's step
        #: is scaled by its size over it.
        self.full_group = 1
        #: The most live workers this policy has seen: with fewer, ``+lr=staleness`` counts a
        #: gradient's staleness as at least the running mean (a job's tail).
        self.full_live = 0
        #: ``+lr=mean``'s power for each rule met under this policy (``mean_rate_power``).
        self._powers: dict[str, float] = {}

    # ---- pushes -----------------------------------------------------------------------------

    def staleness(self, chunks: Sequence[DenseChunk],
                  pulled_versions: Sequence[int]) -> list[int | None]:
        """What :meth:`push` will return for these gradients if it runs next: each one's
        staleness, None where ``+maxstale`` drops it."""
        accepts = self.policy.modifiers.accepts
        result: list[int | None] = []
        for chunk, pulled in zip(chunks, pulled_versions, strict=True):
            staleness = chunk.version - pulled
            staleness = staleness if staleness > 0 else 0
            result.append(staleness if accepts(staleness) else None)
        return result

    def push(
        self,
        table: DenseTable,
        chunks: Sequence[DenseChunk],
        grads: Sequence[np.ndarray],
        pulled_versions: Sequence[int],
        sender: str,
        live: Collection[str],
        membership_known: bool = True,
        ticket: Ticket | None = None,
        rules: Sequence[UpdateRule | None] | None = None,
        tag: object = None,
        bound_workers: int | None = None,
    ) -> list[int | None]:
        """Take one validated gradient per chunk. Returns each gradient's staleness (None
        where ``+maxstale`` dropped it). The updates this push makes (its own, and groups it
        completes) are recorded on ``ticket``. ``rules``: the rule for each chunk (the push's
        live hyperparameters); None: each chunk's group's. ``tag`` (not None): kept with each
        gradient that joins a group, and recorded with the group's update (its ``tags``):
        a replicated primary holds the push's reply until then (ps/group_replies.py).
        ``bound_workers``: the workers the policy's staleness bound counts (default: ``live``);
        a gradient staler than the bound is counted in ``stats.beyond_bound``."""
        if self.policy.waits_for_apply:
            for chunk in chunks:
                group = self._groups.get((table.name, chunk.chunk_id))
                if group is not None and sender in group.contributors:
                    raise ConflictError(
                        f"{sender} already pushed to the open hardsync step of table "
                        f"{table.name!r} chunk {chunk.chunk_id}; pull (and wait) before pushing "
                        "again"
                    )
        modifiers = self.policy.modifiers
        group_size = self.policy.group_size(len(live))
        self.full_group = max(self.full_group, group_size)
        self.full_live = max(self.full_live, len(live))
        short = len(live) < self.full_live
        result = self.staleness(chunks, pulled_versions)  # measured before any is applied
        bound = self.policy.staleness_bound(
            len(live) if bound_workers is None else max(len(live), bound_workers))
        for chunk, grad, staleness, rule in zip(chunks, grads, result,
                                                rules or [None] * len(chunks), strict=True):
            if staleness is None:
                self.stats.dropped += 1
                continue
            self.stats.record_staleness(staleness)
            if bound is not None and staleness > bound:
                self.stats.beyond_bound += 1
            if modifiers.dc_lambda:
                grad = self._compensate(table.name, chunk, grad, sender)
            self._staleness_sum += staleness
            self._staleness_count += 1
            power = (self._mean_rate_power(rule or table.rules.registered_for(chunk.offset))
                     if modifiers.lr_mean else 1.0)
            scale = modifiers.lr_scale(staleness, self._staleness_sum / self._staleness_count,
                                       power, short)
            if group_size == 1 and not self.policy.waits_for_apply:
                chunk.gradients += 1
                self.updates.run(table, chunk, grad, scale / self.full_group, ticket, rule)
                continue
            key = (table.name, chunk.chunk_id)
            group = self._groups.setdefault(key, _Group())
            self._chunks[key] = (table, chunk)
            if group.total is None or not group.contributors:
                group.total = np.multiply(grad, np.float32(scale), out=group.total,
                                          dtype=np.float32)
            elif scale == 1.0:
                np.add(group.total, grad, out=group.total)
            else:
                group.total += np.float32(scale) * grad
            group.contributors.append(sender)
            group.staleness.append(staleness)
            group.scale += scale
            group.rule = rule
            if tag is not None:
                group.tags.append(tag)
        if membership_known:
            self.complete_groups(live, ticket)
        return result

    def _mean_rate_power(self, rule: UpdateRule) -> float:
        """The power of the mean staleness ``+lr=mean`` divides ``rule``'s step by (logged
        once for each rule under each policy)."""
        power = self._powers.get(rule.name)
        if power is None:
            power = self._powers[rule.name] = mean_rate_power(rule.name)
            if (self.policy.spec, rule.name) not in _NOTED:
                _NOTED.add((self.policy.spec, rule.name))
                log.info("%s", rate_rule_note(self.policy.spec, rule.name))
        return power

    def _compensate(
        self, table: str, chunk: DenseChunk, grad: np.ndarray, sender: str
    ) -> np.ndarray:
        """DC-ASGD: g + lambda * g * g * (w_now - w_pulled)."""
        pulled = self._pulled.get((sender, table, chunk.chunk_id))
        if pulled is None:
            return grad
        drift = np.subtract(chunk.weights, pulled)
        drift *= grad
        drift *= grad
        drift *= np.float32(self.policy.modifiers.dc_lambda)
        drift += grad
        return drift

    def _complete(self, group: _Group, live: Collection[str]) -> bool:
        if not group.contributors:
            return False
        if self.policy.waits_for_apply:
            return set(live) <= set(group.contributors)
        return len(group.contributors) >= self.policy.group_size(len(live))

    def complete_groups(self, live: Collection[str], ticket: Ticket | None = None) -> int:
        """Apply every group that is complete for the current live workers; returns how many
        updates were applied. Called after each push and on every membership change."""
        complete = [key for key, group in self._groups.items() if self._complete(group, live)]
        for key in complete:
            self._apply_group(key, ticket)
        return len(complete)

    def _apply_group(self, key: tuple[str, int], ticket: Ticket | None) -> None:
        group = self._groups[key]
        table, chunk = self._chunks[key]
        if group.total is None or not group.contributors:
            return
        size, scale = len(group.contributors), group.scale
        # the factor-weighted mean, its step scaled by the factors' mean times size / full
        # size: sum(scale_i * g_i) / full size for sgd
        group.total *= np.float32(1.0 / scale)
        # the update (and a forward to a backup) keeps the sum; the next group gets a new one
        total, group.total = group.total, None
        tags = tuple(group.tags)
        group.contributors.clear()
        group.staleness.clear()
        group.tags.clear()
        group.scale = 0.0
        chunk.gradients += size
        self.updates.run(table, chunk, total, scale / max(size, self.full_group), ticket,
                         group.rule, tags)

    def apply_open(self, tables: Collection[str], ticket: Ticket | None = None) -> int:
        """Apply the open groups of ``tables`` as they are (short groups, each moving the
        weights by its size over the full size); returns how many were applied."""
        keys = [k for k, g in self._groups.items() if k[0] in tables and g.contributors]
        for key in keys:
            self._apply_group(key, ticket)
        return len(keys)

    def holds(self, table: str, chunk_id: int, tag: object) -> bool:
        """Whether the chunk's open group holds a gradient tagged ``tag``."""
        group = self._groups.get((table, chunk_id))
        return group is not None and any(t is tag for t in group.tags)

    def discard(self, tables: Collection[str]) -> int:
        """Drop the open groups of ``tables`` unapplied (a primary that lost its chunks:
        their workers send those gradients again to the new primary); returns how many
        gradients were dropped."""
        dropped = 0
        for key in [k for k in self._groups if k[0] in tables]:
            dropped += len(self._groups.pop(key).contributors)
            self._chunks.pop(key, None)
        return dropped

    def flush(self, chunks: Collection[tuple[str, int]]) -> int:
        """Apply now what the groups of ``chunks`` ((table, chunk id) pairs) gathered, as a
        short group (a chunk that leaves this server); returns how many were applied."""
        keys = [key for key in chunks if key in self._groups and self._groups[key].contributors]
        for key in keys:
            self._apply_group(key, None)
        return len(keys)

    # ---- pulls ------------------------------------------------------------------------------

    def waiting_on(self, sender: str, table: str, chunk_ids: Sequence[int]) -> bool:
        """Whether a gradient of ``sender`` on these chunks is still waiting in a group (under
        hardsync its pull waits for that)."""
        if not self.policy.waits_for_apply:
            return False
        for chunk_id in chunk_ids:
            group = self._groups.get((table, chunk_id))
            if group is not None and sender in group.contributors:
                return True
        return False

    def remember_pull(self, sender: str, table: str, chunk_id: int, weights: np.ndarray) -> None:
        """Keep the weights a worker read, for delay compensation (only under ``+dc``)."""
        if self.policy.modifiers.dc_lambda:
            self._pulled[(sender, table, chunk_id)] = weights

    def switch(self, policy: ConsistencyPolicy, ticket: Ticket | None = None) -> None:
        """Adopt a new policy at a version boundary: open groups are applied first, as they
        are (recorded on ``ticket``), so no gradient is lost or held across the switch."""
        for key in list(self._groups):
            self._apply_group(key, ticket)
        self.policy = policy
        self._staleness_sum = self._staleness_count = 0
        self.full_group = 1
        self.full_live = 0
        self._powers.clear()
        if not policy.modifiers.dc_lambda:
            self._pulled.clear()
