"""How long things take in a simulated cluster: a learner's compute step and a message.

Both draw from a seeded ``numpy`` generator, so the same seed gives the same times.

Example::

    >>> import numpy as np
    >>> compute = ComputeModel(step_s=0.01, jitter=0.0, stragglers=1, slowdown=3.0)
    >>> rng = np.random.default_rng(0)
    >>> compute.sample(0, rng), compute.sample(1, rng)
    (0.03, 0.01)
    >>> net = NetworkModel(latency_s=50e-6, link_bytes_per_s=1e9, server_s=0.0,
    ...                    server_bytes_per_s=1e9)
    >>> round(net.transfer(1_000_000), 6)
    0.00105
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hogshard.proto.errors import ConfigError

#: Fitted from benchmarks/pushpull.py on one host (RESULTS.md, pushpull): a 4-byte push or pull
#: round trip takes ~0.21 ms (2 x latency + the server's per-message work) and a 16 MiB push
#: ~9.3 ms (every byte crosses the link and the server: 1.8 GB/s end to end).
DEFAULT_LATENCY_S = 40e-6
DEFAULT_SERVER_S = 130e-6
DEFAULT_LINK_BYTES_PER_S = 3.6e9
DEFAULT_SERVER_BYTES_PER_S = 3.6e9


def _positive(name: str, value: float, allow_zero: bool = True) -> float:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ConfigError(f"{name} must be a finite number {'>=' if allow_zero else '>'} 0, "
                          f"got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ComputeModel:
    """A learner's step time: ``step_s`` times a log-normal factor of mean 1 and coefficient of
    variation ``jitter``; the first ``stragglers`` learners take ``slowdown`` times longer;
    every learner's first step takes ``first_step_s`` longer (a real worker's warm-up: its
    first forward and backward, after its first pull)."""

    step_s: float
    jitter: float = 0.1
    stragglers: int = 0
    slowdown: float = 1.0
    first_step_s: float = 0.0

    def __post_init__(self) -> None:
        _positive("compute step time", self.step_s, allow_zero=False)
        _positive("compute jitter", self.jitter)
        _positive("straggler slowdown", self.slowdown, allow_zero=False)
        _positive("first-step warm-up", self.first_step_s)
        if self.stragglers < 0:
            raise ConfigError(f"stragglers must be >= 0, got {self.stragglers}")

    def sample(self, learner: int, rng: np.random.Generator) -> float:
        """Seconds of compute for one step of ``learner``."""
        base = self.step_s * (self.slowdown if learner < self.stragglers else 1.0)
        if self.jitter == 0:
            return base
        sigma2 = math.log1p(self.jitter ** 2)
        return base * float(rng.lognormal(-sigma2 / 2, math.sqrt(sigma2)))


@dataclass(frozen=True)
class NetworkModel:
    """A message takes ``latency_s + bytes / link_bytes_per_s`` on the wire; a server spends
    ``server_s + bytes / server_bytes_per_s`` on it (decode, apply or copy), one at a time."""

    latency_s: float = DEFAULT_LATENCY_S
    link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S
    server_s: float = DEFAULT_SERVER_S
    server_bytes_per_s: float = DEFAULT_SERVER_BYTES_PER_S

    def __post_init__(self) -> None:
        _positive("network latency", self.latency_s)
        _positive("link bandwidth", self.link_bytes_per_s, allow_zero=False)
        _positive("server time per message", self.server_s)
        _positive("server bandwidth", self.server_bytes_per_s, allow_zero=False)

    def transfer(self, nbytes: int) -> float:
        """Seconds for a message of ``nbytes`` payload to reach the other end."""
        return self.latency_s + nbytes / self.link_bytes_per_s

    def service(self, nbytes: int) -> float:
        """Seconds a server is busy with a message of ``nbytes`` payload."""
        return self.server_s + nbytes / self.server_bytes_per_s

    def fan_in_bound(self, model_bytes: float, servers: int) -> float:
        """The most learner steps a second that ``servers`` servers can serve, however many
        learners there are. Every step of every learner reaches every server (a push of its
        share, a pull request, and the weights copied out), so a server spends
        ``3 x server_s + 2 x share / bandwidth`` on each step, and the servers work in parallel:
        more servers shrink the share but not the fixed part, so no S lifts the bound above
        ``1 / (3 x server_s)``."""
        share = model_bytes / servers
        return 1.0 / (3 * self.server_s + 2 * share / self.server_bytes_per_s)
