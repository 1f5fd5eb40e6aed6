"""A timing-only workload: a model of a given size whose gradients cost nothing to compute.

For questions of scale (1,000 learners, 100 servers) the simulator needs the traffic and the
server work of a large model, not its arithmetic. The servers hold a few real elements per
chunk (the real stores and rules still apply every push) while every message is charged the
bytes of the full model's share: ``bytes_per_element`` scales each chunk's real length to the
declared ``parameters``. Accuracy is not measured (``None``).

Example::

    >>> work = SyntheticWorkload(parameters=25_000_000, steps=3, elements=8)
    >>> work.size, work.bytes_per_element
    (8, 12500000.0)
    >>> len(work.batch_indices(rank=0, epoch=0, learners=4, batch=32))
    3
    >>> work.accuracy(work.initial_weights()) is None
    True
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hogshard.proto.errors import ConfigError


class SyntheticWorkload:
    """``steps`` batches per learner and epoch of a ``parameters``-element float32 model,
    represented on the servers by ``elements`` real elements."""

    def __init__(self, parameters: int, steps: int, elements: int, seed: int = 0) -> None:
        if parameters < 1 or steps < 1 or elements < 1:
            raise ConfigError(f"a synthetic model needs parameters, steps and elements >= 1, "
                              f"got {parameters}, {steps}, {elements}")
        self.parameters = parameters
        self.steps = steps
        self.size = min(elements, parameters)
        self.bytes_per_element = 4.0 * parameters / self.size
        rng = np.random.default_rng([seed, 0x5E])
        self._initial = rng.standard_normal(self.size).astype(np.float32)
        self._grad = (1e-3 * rng.standard_normal(self.size)).astype(np.float32)
        self._grad.flags.writeable = False
        self._batch = np.zeros(0, np.int64)

    def initial_weights(self) -> np.ndarray:
        return self._initial.copy()

    def batch_indices(self, rank: int, epoch: int, learners: int, batch: int) -> list[np.ndarray]:
        return [self._batch] * self.steps

    def gradient(self, weights: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, float]:
        return self._grad, 0.0

    def accuracy(self, weights: np.ndarray, full: bool = False) -> float | None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"dataset": "synthetic (timing only)", "model": "synthetic", "train_images": None,
                "parameters": self.parameters}
