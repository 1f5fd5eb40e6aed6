"""Row gradients pushed in backward (TorchRec's optimizer-in-backward convention): each
:class:`RemoteEmbeddingBag` forward makes a leaf of the rows it pulled, and a hook on that leaf
hands its gradient here as soon as backward has accumulated it; when backward ends, the
gradients of every bag of the client that got some go to the servers in one push (one request
per server), and their table's row rule applies them. The rows train whatever optimizer the
script steps, or none; nothing is left for a step to push.

A push is not waited for at once: the next backward's push (or :func:`wait`, which
``push_gradients``, ``flush`` and ``client.close`` call) waits for it, and a failure raises
there; a push of ``pipeline`` bags only is waited for by their next push or ``flush``. The rows of ``"exact"`` pipeline bags announced for the next step are pulled right
behind the push, on the same connections, so they read its update.

A table whose rule was not chosen (``rule=None``: the default ``rowwise_adagrad``) is checked
at the first step of a ``torch.optim`` optimizer (any but hogshard's own): the script steps an
optimizer the rows do not follow, which is a ConfigError naming the rule to pass.

Example (what a bag does; a script never calls it)::

    pushes = row_pushes(client)
    pushes.add(bag, ids, leaf.grad)      # from the leaf's hook, during backward
    # ... at the end of backward: one push for every bag, sent
    pushes.wait()                        # every push applied (or its error raised)
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.autograd import Variable
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hogshard.proto.errors import ConfigError
from hogshard.worker.device import to_host
from hogshard.worker.futures import Future
from hogshard.worker.row_optim import row_rule_of

if TYPE_CHECKING:
    from hogshard.worker.client import PSClient
    from hogshard.worker.embedding import RemoteEmbeddingBag

log = logging.getLogger(__name__)


class RowPushes:
    """The row gradients of one client's bags gathered during a backward, and the pushes not
    yet waited for."""

    def __init__(self, client: PSClient) -> None:
        self.client = client
        self.gathered: list[tuple[RemoteEmbeddingBag, np.ndarray, torch.Tensor]] = []
        self.sending: list[Future] = []  # pushes not waited for (at most one backward's)
        self.last_piped: Future | None = None  # the last push of pipeline bags only
        self.unchosen: weakref.WeakSet[RemoteEmbeddingBag] = weakref.WeakSet()
        self._step_hook: Any = None

    def add(self, bag: RemoteEmbeddingBag, ids: np.ndarray, grad: torch.Tensor) -> None:
        """Take a leaf's gradient (from its hook); the first of a backward schedules the push
        at its end."""
        if not self.gathered:
            Variable._execution_engine.queue_callback(self.send)
        self.gathered.append((bag, ids, grad))

    def send(self) -> None:
        """Push every gradient gathered in this backward, in one request per server; wait for
        the previous backward's push first (at most one in flight)."""
        gathered, self.gathered = self.gathered, []
        if not gathered:
            return
        self.wait()
        from hogshard.worker.embedding import flush, pull_announced

        bags: list[RemoteEmbeddingBag] = []
        for bag, _, _ in gathered:
            if bag not in bags:
                bags.append(bag)
        flush(self.client, bags)  # a pipelined bag's previous push first
        grads = to_host([g for _, _, g in gathered])
        tables, ids, rows = [], [], []
        for bag in bags:
            mine = [(i, g) for (b, i, _), g in zip(gathered, grads, strict=True) if b is bag]
            bag_ids, bag_grads = merge(mine)
            keep = bag.pushed_ids(bag_ids)
            tables.append(bag.handle)
            ids.append(bag_ids[keep])
            rows.append(np.ascontiguousarray(bag_grads[keep], np.float32))
        future = self.client.push_rows(tables, ids, rows, self.client.clock)
        pull_announced(bags)
        for bag in bags:
            if bag.pipeline is not None:
                bag.in_flight.pushing = future  # waited for by the bag's next push or flush
        if any(bag.pipeline is None for bag in bags):
            self.sending.append(future)
        else:
            self.last_piped = future

    def wait(self, pipelined: bool = False) -> None:
        """Wait until the servers applied every push sent (``pipelined``: that of pipeline
        bags too); the first failure raises."""
        sending, self.sending = self.sending, []
        if pipelined and self.last_piped is not None:
            sending.append(self.last_piped)
            self.last_piped = None
        for future in sending:
            future.result(self.client.settings.request_timeout)

    def close(self) -> None:
        """Stop checking torch optimizers' steps (the client leaves the job)."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self.unchosen = weakref.WeakSet()

    def watch_rule(self, bag: RemoteEmbeddingBag) -> None:
        """Check, at the first step of a torch optimizer, that a table whose rule was not
        chosen is not trained by a script that means another rule."""
        self.unchosen.add(bag)
        if self._step_hook is None:
            this = weakref.ref(self)

            def check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                pushes = this()
                if pushes is not None:
                    pushes.check_rule(optimizer)

            self._step_hook = register_optimizer_step_pre_hook(check)
            weakref.finalize(self, self._step_hook.remove)

    def check_rule(self, optimizer: torch.optim.Optimizer) -> None:
        """The step hook: refuse a step of a torch optimizer while a table whose rule was not
        chosen has rows trained with the default rule."""
        if type(optimizer).__module__.startswith("hogshard."):
            return  # PSOptimizer: its tables' rules are the job's own
        trained = [bag for bag in self.unchosen if bag.trained]
        if not trained:
            return
        names = sorted(bag.handle.name for bag in trained)
        try:
            meant = f"here: rule={row_rule_of(optimizer)!r}"
        except ConfigError as err:
            meant = f"({err})"
        raise ConfigError(
            f"embedding tables {names} update their rows with the default row rule "
            f"{trained[0].handle.spec.rule!r} while this script steps "
            f"{type(optimizer).__name__}: pass the rule the rows should follow to "
            f"RemoteEmbeddingBag(rule=...) or remote_embeddings(rule=...), e.g. "
            f"rule=torch.optim.{type(optimizer).__name__} with its arguments {meant}, or "
            "rule='rowwise_adagrad' to keep the default")


def merge(pieces: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, gradient rows) pieces as one: the rows of an id that several hold summed."""
    if len(pieces) == 1:
        return pieces[0]
    ids = np.concatenate([p[0] for p in pieces])
    grads = np.concatenate([p[1] for p in pieces])
    uniq, inverse = np.unique(ids, return_inverse=True)
    summed = np.zeros((uniq.size, grads.shape[1]), np.float32)
    np.add.at(summed, inverse, grads)
    return uniq, summed


def row_pushes(client: PSClient) -> RowPushes:
    """The client's :class:`RowPushes` (made at its first bag)."""
    pushes = client.row_pushes
    if pushes is None:
        pushes = client.row_pushes = RowPushes(client)
    return pushes
