"""float32 <-> IEEE half precision for the ``fp16`` codec, on the fastest kernel at hand.

numpy converts to and from ``float16`` one element at a time (about 2 ns an element here, and
tens of ns for values that round to subnormal halves); torch's CPU kernels use the processor's
conversion instructions (F16C), tens of times faster. ``proto`` never imports torch: where the
process has imported it already (a worker does), these functions convert with it, and elsewhere
(servers and the scheduler never import torch) float32 -> half runs as whole-block numpy
arithmetic (``half_bits.py``) and half -> float32 as numpy's cast. All round to nearest even and
give the same bits; small arrays stay with numpy's cast, whose per-call cost is lower.

Example::

    >>> import numpy as np
    >>> half = to_half(np.array([1 / 3, 70000.0], dtype=np.float32))
    >>> half.dtype.str, half.tolist()
    ('<f2', [0.333251953125, inf])
    >>> to_float(half).tolist()
    [0.333251953125, inf]
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import numpy as np

from hogshard.proto.codecs.half_bits import float_to_half

HALF = np.dtype("<f2")
FLOAT = np.dtype("<f4")
#: Below this many elements numpy's cast is as fast as a call into torch or the block arithmetic.
TORCH_FROM = 4096


def _torch() -> Any:
    """torch, if this process has imported it (never imports it)."""
    return sys.modules.get("torch")


def _convert(src: np.ndarray, out: np.ndarray) -> np.ndarray:
    torch = _torch()
    if src.size < TORCH_FROM:
        np.copyto(out, src, casting="unsafe")
        return out
    if torch is None or not hasattr(torch, "from_numpy"):
        if out.dtype == HALF:
            return float_to_half(src, out)
        np.copyto(out, src, casting="unsafe")
        return out
    if src.flags.writeable:
        source = torch.from_numpy(src)
    else:  # a received frame: torch only reads it, but warns about any read-only array
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            source = torch.from_numpy(src)
    torch.from_numpy(out).copy_(source)
    return out


def to_half(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """1-D little-endian float32 ``values`` as ``<f2`` (into ``out`` when given)."""
    if out is None:
        out = np.empty(values.shape, dtype=HALF)
    return _convert(values, out)


def to_float(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """1-D ``<f2`` ``values`` as float32 (into ``out`` when given)."""
    if out is None:
        out = np.empty(values.shape, dtype=FLOAT)
    return _convert(values, out)
