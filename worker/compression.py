"""Worker-side compression: error feedback, DGC momentum correction, and the per-table policy.

Codecs (``hogshard.proto.codecs``) are stateless; what a lossy codec drops is worker state and
lives here. :class:`ErrorFeedback` adds each slice's residual to its next gradient before
encoding, so over time every coordinate's full gradient mass is sent. :class:`DGC` adds Deep
Gradient Compression's momentum correction (the momentum lives on the worker, so the server
should apply plain SGD to such a table), momentum factor masking and local gradient clipping.
:class:`CompressionPolicy` (pure, :mod:`hogshard.worker.compression_policy`) says which codec a
table's slice of a given size uses at a given step, and :class:`Compressor` (stateful) applies
a policy to a worker's pushes, counting each slice's steps for DGC's sparsity warm-up. No torch
here.

Example::

    >>> import numpy as np
    >>> compressor = Compressor(CompressionPolicy.parse("topk:0.5,min_size=4"))
    >>> codec, enc = compressor.compress("model", 0, np.array([1, -4, 2, 0.5], dtype=np.float32))
    >>> codec.spec(), codec.decode(enc, 4).tolist()
    ('topk:0.5', [0.0, -4.0, 2.0, 0.0])
    >>> compressor.feedback_for("model").residual(("model", 0)).tolist()
    [1.0, 0.0, 0.0, 0.5]
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np

from hogshard.proto.codecs import (
    NO_INFO,
    Codec,
    CodecInfo,
    CodecState,
    Encoded,
    RandomKCodec,
    TopKCodec,
)
from hogshard.proto.codecs.base import check_grad, check_seed
from hogshard.proto.codecs.lowrank import Layers, PowerSGDCodec, slice_layers
from hogshard.proto.errors import ConfigError, ProtocolError, ShapeError
from hogshard.worker.compression_policy import CompressionPolicy, TableRule

__all__ = ["DGC", "CompressionPolicy", "Compressor", "ErrorFeedback", "TableRule", "message_seed"]


def message_seed(*parts: int | str) -> int:
    """A 64-bit seed derived from e.g. (worker rank, step, table, chunk), stable across processes.

    Example::

        >>> message_seed(3, 120, "model", 7) == message_seed(3, 120, "model", 7)
        True
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _clip(grad: np.ndarray, clip_norm: float | None) -> np.ndarray:
    if clip_norm is None:
        return grad
    norm = float(np.linalg.norm(grad))
    if math.isfinite(norm) and norm > clip_norm:
        return grad * np.float32(clip_norm / norm)
    return grad


class ErrorFeedback:
    """Per-slice residual memory for lossy codecs, keyed by e.g. ``(table, chunk_id)``.

    ``compress`` encodes ``grad + residual`` and keeps ``(grad + residual) - decode(sent)`` as
    the next residual, so ``sum(decoded) + residual == sum(grads)`` at every step. Lossless
    codecs keep no residual (a pending one is sent along). ``feedback=False`` keeps none at all
    (codec state such as PowerSGD's warm start is still kept). ``clip_norm`` scales each
    incoming slice down to that L2 norm first. Use contractive codecs (topk, sign, fp16/bf16,
    powersgd, ``randomk:R:biased``); the unbiased ones (qsgd, scaled randomk) have a variance
    that error feedback accumulates, so send them with ``feedback=False``.

    Example::

        >>> import numpy as np
        >>> from hogshard.proto.codecs import make_codec
        >>> ef = ErrorFeedback()
        >>> enc = ef.compress("a", np.array([3.0, 1.0], dtype=np.float32), make_codec("topk:0.5"))
        >>> ef.residual("a").tolist()
        [0.0, 1.0]
    """

    def __init__(self, *, feedback: bool = True, clip_norm: float | None = None) -> None:
        if clip_norm is not None and not (math.isfinite(clip_norm) and clip_norm > 0):
            raise ConfigError(f"clip_norm must be a positive number; got {clip_norm!r}")
        self.feedback = feedback
        self.clip_norm = clip_norm
        self._residuals: dict[Hashable, np.ndarray] = {}
        self._states: dict[Hashable, tuple[str, CodecState]] = {}

    def compress(self, key: Hashable, grad: np.ndarray, codec: Codec,
                 info: CodecInfo = NO_INFO) -> Encoded:
        """Encode ``grad`` (plus ``key``'s residual) with ``codec``; update the residual.
        ``info``: the slice's seed and, for codecs that compress per layer, its layers."""
        grad = _clip(check_grad(grad), self.clip_norm)
        check_seed(info.seed)  # before any change
        if not codec.lossless:
            _check_finite(key, grad)
        residual = self._take(self._residuals, key, grad.size, "residual")
        state = self._state(key, codec)
        if residual is not None:
            residual += grad
        if codec.lossless or not self.feedback:
            return codec.encode(grad if residual is None else residual, info, state)
        corrected = grad.copy() if residual is None else residual
        encoded = codec.encode(corrected, info, state)
        self._residuals[key] = self._leftover(codec, encoded, corrected)
        return encoded

    @staticmethod
    def _leftover(codec: Codec, encoded: Encoded, corrected: np.ndarray) -> np.ndarray:
        """``corrected - decode(encoded)``, computed in place in ``corrected`` when safe."""
        if any(np.may_share_memory(b, corrected) for b in encoded.buffers):
            corrected = corrected.copy()
        if isinstance(codec, (TopKCodec, RandomKCodec)) and codec.sends_exact_values:
            indices, _ = codec.to_sparse(encoded, corrected.size)
            corrected[indices] = 0.0  # the values were sent exactly
        else:
            corrected -= codec.decode(encoded, corrected.size)
        return corrected

    def _take(self, store: dict[Hashable, np.ndarray], key: Hashable, size: int, what: str) -> np.ndarray | None:
        kept = store.pop(key, None)
        if kept is not None and kept.size != size:
            store[key] = kept
            raise ShapeError(
                f"the {what} kept for {key!r} has {kept.size} elements but the gradient has {size}; "
                "call reset(key) after re-chunking a table"
            )
        return kept

    def _state(self, key: Hashable, codec: Codec) -> CodecState:
        spec = codec.spec()
        kept = self._states.get(key)
        if kept is None or kept[0] != spec:
            kept = (spec, CodecState())
            self._states[key] = kept
        return kept[1]

    def residual(self, key: Hashable) -> np.ndarray | None:
        """The residual kept for ``key`` (``None`` if none); do not modify it."""
        return self._residuals.get(key)

    def reset(self, key: Hashable | None = None) -> None:
        """Forget everything kept for ``key`` (or for every key)."""
        for store in [*self._arrays(), self._states]:
            if key is None:
                store.clear()
            else:
                store.pop(key, None)

    def _arrays(self) -> list[dict[Hashable, Any]]:
        return [self._residuals]

    def state_dict(self) -> dict[str, Any]:
        """Copies of the residuals (and momenta), for a checkpoint."""
        return {"residuals": {k: v.copy() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._residuals = {k: np.array(v, dtype=np.float32) for k, v in state["residuals"].items()}


class DGC(ErrorFeedback):
    """Deep Gradient Compression (Lin et al. 2018) on top of error feedback.

    Per slice: clip ``g`` to ``clip_norm``; ``u = momentum * u + g``; ``v = v + u``; send
    ``v`` with the codec. With ``topk`` the sent coordinates of both ``v`` and ``u`` are zeroed
    (momentum factor masking); with another lossy codec ``v`` keeps ``v - decode(sent)``; with
    a lossless one ``v`` is emptied. The server must apply plain SGD: the momentum is here.

    Example::

        >>> import numpy as np
        >>> from hogshard.proto.codecs import make_codec
        >>> dgc = DGC(momentum=0.9)
        >>> codec = make_codec("topk:0.5")
        >>> dgc.compress("a", np.array([1.0, 0.5], dtype=np.float32), codec).buffers[0].tolist()
        [1.0]
        >>> dgc.compress("a", np.array([1.0, 0.5], dtype=np.float32), codec).buffers[0].tolist()
        [1.4500000476837158]
    """

    def __init__(self, momentum: float = 0.9, *, clip_norm: float | None = None) -> None:
        super().__init__(feedback=True, clip_norm=clip_norm)
        if not (isinstance(momentum, (int, float)) and 0.0 <= momentum < 1.0):
            raise ConfigError(f"DGC momentum must be in [0, 1); got {momentum!r}")
        self.momentum = float(momentum)
        self._momenta: dict[Hashable, np.ndarray] = {}

    def compress(self, key: Hashable, grad: np.ndarray, codec: Codec,
                 info: CodecInfo = NO_INFO) -> Encoded:
        grad = _clip(check_grad(grad), self.clip_norm)
        check_seed(info.seed)
        _check_finite(key, grad)
        velocity = self._take(self._residuals, key, grad.size, "accumulated gradient")
        momentum = self._take(self._momenta, key, grad.size, "momentum")
        if momentum is None:
            momentum = grad.copy()
        else:
            momentum *= np.float32(self.momentum)
            momentum += grad
        self._momenta[key] = momentum
        if velocity is None:
            velocity = momentum.copy()
        else:
            velocity += momentum
        encoded = codec.encode(velocity, info, self._state(key, codec))
        if codec.lossless:
            return encoded
        if isinstance(codec, TopKCodec):
            indices, values = codec.to_sparse(encoded, grad.size)
            velocity[indices] -= values  # 0 where sent exactly; what rounding left (compact)
            momentum[indices] = 0.0
        else:
            velocity = self._leftover(codec, encoded, velocity)
        self._residuals[key] = velocity
        return encoded

    def _arrays(self) -> list[dict[Hashable, Any]]:
        return [self._residuals, self._momenta]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "momenta": {k: v.copy() for k, v in self._momenta.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self._momenta = {k: np.array(v, dtype=np.float32) for k, v in state.get("momenta", {}).items()}


def _check_finite(key: Hashable, grad: np.ndarray) -> None:
    """Refuse a slice holding NaN or Inf before it reaches a residual (as a server refuses an
    uncompressed one), so a diverged step says so instead of failing in a codec."""
    with np.errstate(over="ignore", invalid="ignore"):
        square_sum = float(np.dot(grad, grad)) if grad.size else 0.0
    if not math.isfinite(square_sum):
        raise ProtocolError(f"the gradient of {key!r} holds NaN or Inf (or overflows): the "
                            "training diverged; expected finite values")


class Compressor:
    """A worker's compression state: applies a policy, one feedback memory per table.

    Each slice's pushes are counted, so a rule with ``warmup`` sends its warm-up densities on
    the slice's first steps; a warm-up given as a percentage of the run (``dgc``'s) takes its
    length from :attr:`total_steps` (the run's steps, which the optimizer sets). A table
    whose rule is ``auto`` must be resolved first
    (:meth:`resolve`, which :class:`~hogshard.worker.optimizer.PSOptimizer` calls from the
    measured link). :meth:`set_layers` tells it how a table's flat buffer splits into layers
    (the optimizer passes its parameters' shapes), so ``powersgd`` compresses layer by layer;
    without it a slice is one flat matrix.

    Example::

        >>> import numpy as np
        >>> compressor = Compressor("sign")
        >>> codec, enc = compressor.compress("model", 3, np.ones(16, dtype=np.float32), seed=1)
        >>> codec.spec(), enc.nbytes
        ('sign', 6)
    """

    def __init__(self, policy: CompressionPolicy | str) -> None:
        self.policy = policy if isinstance(policy, CompressionPolicy) else CompressionPolicy.parse(policy)
        self._feedback: dict[str, ErrorFeedback] = {}
        self._steps: dict[Hashable, int] = {}
        self._layers: dict[str, list[tuple[int, int]]] = {}
        self._slices: dict[tuple[str, int, int], tuple[tuple[int, int], ...]] = {}
        #: The run's steps (pushes of each slice), for a warm-up given as a percentage.
        self.total_steps: int | None = None

    def set_layers(self, table: str, layers: Layers) -> None:
        """``table``'s flat buffer holds these ``(rows, cols)`` layers end to end
        (:func:`~hogshard.proto.codecs.lowrank.layer_matrix` of each parameter's shape)."""
        self._layers[table] = [(int(r), int(c)) for r, c in layers]
        self._slices = {k: v for k, v in self._slices.items() if k[0] != table}

    def _layers_of(self, table: str, offset: int | None,
                   size: int) -> tuple[tuple[int, int], ...] | None:
        layers = self._layers.get(table)
        if layers is None or offset is None:
            return None
        key = (table, offset, size)
        cut = self._slices.get(key)
        if cut is None:
            cut = self._slices[key] = tuple(slice_layers(layers, offset, size))
        return cut

    def resolve(self, table: str, rule: TableRule) -> None:
        """Give ``table`` its own ``rule`` (what ``auto`` chose); its state starts afresh."""
        self.policy = self.policy.with_rule(table, rule)
        self.reset(table)

    def feedback_for(self, table: str) -> ErrorFeedback:
        """The table's :class:`ErrorFeedback` (or :class:`DGC`), created on first use."""
        feedback = self._feedback.get(table)
        if feedback is None:
            rule = self.policy.rule_for(table)
            if rule.momentum:
                feedback = DGC(rule.momentum, clip_norm=rule.clip_norm)
            else:
                feedback = ErrorFeedback(feedback=rule.error_feedback, clip_norm=rule.clip_norm)
            self._feedback[table] = feedback
        return feedback

    def compress(self, table: str, chunk: Hashable, grad: np.ndarray, seed: int = 0,
                 offset: int | None = None) -> tuple[Codec, Encoded]:
        """The codec used and the payload for one slice (key ``(table, chunk)``) that starts
        at element ``offset`` of the table (needed for per-layer compression)."""
        key = (table, chunk)
        step = self._steps.get(key, 0)
        codec = self.policy.codec_for(table, grad.size, step, self.total_steps)
        layers = self._layers_of(table, offset, grad.size) if isinstance(codec, PowerSGDCodec) else None
        encoded = self.feedback_for(table).compress(key, grad, codec,
                                                    CodecInfo(table, layers, seed, step))
        self._steps[key] = step + 1
        return codec, encoded

    def reset(self, table: str | None = None) -> None:
        """Forget the residuals (and momenta, and step counts) of ``table``, or of every table."""
        if table is None:
            self._feedback.clear()
            self._steps.clear()
        else:
            self._feedback.pop(table, None)
            self._steps = {k: v for k, v in self._steps.items() if k[0] != table}  # type: ignore[index]
