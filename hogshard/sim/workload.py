"""The model a simulation trains: the Fashion-MNIST example's CNN on its data, in torch.

The example (``examples/fashion_mnist.py``) is the one definition of the model, its seeded
initialisation and its per-worker shuffle; this module loads it by path and turns it into two
calls on flat float32 vectors, the form a server stores: a gradient at given weights on given
images, and the test accuracy of given weights. ``model="mlp"`` trains a smaller real model on
the same data instead (one hidden layer of 64; a tenth of the CNN's compute per gradient), for
tables of many long cells.

Example::

    workload = Workload.fashion_mnist(data_dir=None, seed=0)
    grad = workload.gradient(workload.initial_weights(), workload.batch_indices(0, 0, 4, 64)[0])
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from hogshard.datasets import ImageDataset, load_image_dataset
from hogshard.proto.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fashion_mnist.py"
#: The models a workload can train: the example's CNN, or a one-hidden-layer perceptron.
MODELS = ("cnn", "mlp")
MLP_HIDDEN = 64


def load_example(path: Path = EXAMPLE) -> ModuleType:
    """The example module (loaded once per process, by path: ``examples/`` is no package)."""
    name = "hogshard_example_fashion_mnist"
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ConfigError(f"the simulator trains the model of {path}, which is missing; run it "
                          "from a checkout of the repository")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Workload:
    """A torch model evaluated at flat weight vectors, and the data it trains on."""

    #: Wire bytes of one parameter (float32).
    bytes_per_element = 4.0

    def __init__(self, data: ImageDataset, seed: int, limit: int | None = None,
                 eval_subset: int | None = None, model: str = "cnn") -> None:
        import torch

        if model not in MODELS:
            raise ConfigError(f"unknown model {model!r}; expected one of {', '.join(MODELS)}")
        self._torch = torch
        self._example = load_example()
        self.data = data
        self.seed = seed
        self.model_name = model
        self.train_size = min(len(data.train_y), limit) if limit else len(data.train_y)
        self.model = (self._example.make_model(data, seed) if model == "cnn"
                      else _make_mlp(data, seed))
        self._params = list(self.model.parameters())
        self.size = sum(p.numel() for p in self._params)
        with torch.no_grad():
            self._initial = torch.cat([p.reshape(-1) for p in self._params]).numpy().copy()
        cut = eval_subset or len(data.test_y)
        self._eval = (data.test_x[:cut], data.test_y[:cut])

    @classmethod
    def fashion_mnist(cls, data_dir: Path | None, seed: int, limit: int | None = None,
                      eval_subset: int | None = None, model: str = "cnn") -> Workload:
        """The example's data (Fashion-MNIST, or its fallback when absent) and model."""
        return cls(load_image_dataset(data_dir), seed, limit, eval_subset, model)

    def initial_weights(self) -> np.ndarray:
        """The seeded model's parameters as one float32 vector."""
        return self._initial.copy()

    def _load(self, weights: np.ndarray) -> None:
        with self._torch.no_grad():
            offset = 0
            for p in self._params:
                n = p.numel()
                p.copy_(self._torch.from_numpy(weights[offset:offset + n]).view_as(p))
                offset += n

    def batch_indices(self, rank: int, epoch: int, learners: int, batch: int) -> list[np.ndarray]:
        """Learner ``rank``'s batches for one epoch: its share of the example's seeded shuffle."""
        order = self._example.batch_order(self.train_size, epoch, self.seed, rank, learners)
        return [order[start:start + batch] for start in range(0, len(order), batch)]

    def gradient(self, weights: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, float]:
        """The flat float32 gradient of the mean cross-entropy at ``weights`` on the training
        images ``index``, and the loss."""
        torch = self._torch
        self._load(weights)
        self.model.zero_grad(set_to_none=False)
        x = torch.from_numpy(self.data.train_x[index])
        y = torch.from_numpy(self.data.train_y[index])
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        grad = torch.cat([p.grad.reshape(-1) for p in self._params]).numpy()
        return grad.astype(np.float32, copy=True), loss.item()

    def accuracy(self, weights: np.ndarray, full: bool = False) -> float:
        """Test accuracy at ``weights``: on the evaluation subset, or the whole test set."""
        self._load(weights)
        x, y = (self.data.test_x, self.data.test_y) if full else self._eval
        return float(self._example.accuracy(self.model, x, y))

    def describe(self) -> dict[str, Any]:
        return {"dataset": self.data.name, "train_images": self.train_size,
                "parameters": self.size, "model": self.model_name}


def _make_mlp(data: ImageDataset, seed: int) -> Any:
    """A seeded perceptron with one hidden layer, for the example's images, which it first
    standardises by the training set's mean and deviation (fixed, not trained)."""
    import torch
    from torch import nn

    class Standardise(nn.Module):
        def __init__(self, mean: float, std: float) -> None:
            super().__init__()
            self.mean, self.scale = mean, 1.0 / std

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x.flatten(1) - self.mean) * self.scale

    torch.manual_seed(seed)
    side = data.train_x.shape[-1]
    return nn.Sequential(Standardise(float(data.train_x.mean()), float(data.train_x.std())),
                         nn.Linear(side * side, MLP_HIDDEN), nn.ReLU(),
                         nn.Linear(MLP_HIDDEN, data.num_classes))
