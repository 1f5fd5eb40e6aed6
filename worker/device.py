"""Where a worker's weights live: on the model's device, with host arrays for the client.

The client sends and receives numpy arrays; the model may be on a GPU. A :class:`DeviceMirror`
owns the flat buffer that the parameters are views of (on their device) and the host buffers
that pushes read and pulls land in, and moves data between them:

- on the CPU (:class:`HostMirror`) the host weights *are* the parameters' flat buffer: a pull
  lands straight in the model and nothing is copied;
- on CUDA (:class:`hogshard.worker.cuda.CudaMirror`) the host buffers are pinned; gradients go
  device -> host on a side stream, weights host -> device without blocking the CPU, and the
  model's stream waits on an event before it next reads the weights.

Nothing here touches CUDA unless a parameter is on a CUDA device, so importing the worker on a
CPU-only machine never initialises it.

Example::

    params = list(model.parameters())
    mirror = make_mirror(params)                 # the parameters now view mirror.flat
    client.pull(table, mirror.weights.array).result()
    mirror.upload(mirror.weights)                # the model uses the pulled weights
    loss.backward()
    for p, (start, stop) in zip(params, mirror.ranges):
        mirror.copy_grad(start, stop, p.grad)
    mirror.fence().wait()                        # mirror.grads.array holds every gradient
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from hogshard.proto.errors import ConfigError

DEVICE_CHOICES = ("auto", "cpu", "cuda")


class Fence(Protocol):
    """The point a queue of device copies had reached when the fence was made."""

    def ready(self) -> bool:
        """True once those copies are done (never blocks)."""
        ...

    def wait(self) -> None:
        """Block until those copies are done."""
        ...


class Done:
    """A fence that is always passed: the CPU copies synchronously."""

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = Done()


@dataclass
class HostBuffer:
    """A flat float32 host buffer seen both as a tensor and as a numpy array (same memory).

    ``busy`` is the last device copy that reads it: wait on it before writing the buffer."""

    tensor: torch.Tensor
    array: np.ndarray = field(init=False, repr=False)
    busy: Fence = field(default=DONE, repr=False)

    def __post_init__(self) -> None:
        self.array = self.tensor.numpy()

    def writable(self) -> np.ndarray:
        """The array, once no device copy reads it any more (for a pull to land in)."""
        self.busy.wait()
        return self.array


class DeviceMirror(Protocol):
    """The parameters' flat buffer on their device and its host side (see module docstring)."""

    device: torch.device
    flat: torch.Tensor  # every parameter is a view of it, on ``device``
    ranges: list[tuple[int, int]]  # parameter i is flat[start:stop]
    weights: HostBuffer  # host weights: pulls land here
    grads: HostBuffer  # host gradients: pushes read them
    staging_depth: int  # host buffers a prefetch rotates through

    def new_buffer(self) -> HostBuffer:
        """A host buffer of the table's size that :meth:`upload` can copy from."""
        ...

    def copy_grad(self, start: int, stop: int, grad: torch.Tensor) -> None:
        """Queue the copy of one parameter's gradient into ``grads.array[start:stop]``."""
        ...

    def fence(self) -> Fence:
        """A fence passed once every gradient copy queued so far is in ``grads``."""
        ...

    def gather_grads_in(self, array: np.ndarray) -> bool:
        """Gather the gradients in ``array`` (flat float32, the parameters' total size; e.g.
        the client's shared-memory gradient buffer) from now on; False where it cannot."""
        ...

    def upload(self, source: HostBuffer) -> None:
        """Make the device weights equal ``source`` before the model next uses them; sets
        ``source.busy`` while the copy still reads it."""
        ...


def param_ranges(params: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """The [start, stop) of each parameter in the flat buffer, in order."""
    ranges, offset = [], 0
    for p in params:
        ranges.append((offset, offset + p.numel()))
        offset += p.numel()
    return ranges


def flatten_into_views(params: Sequence[torch.nn.Parameter],
                       device: torch.device | None = None) -> torch.Tensor:
    """Copy the parameters into one flat float32 tensor on ``device`` (by default the first
    parameter's) and make each parameter a view of it."""
    where = device if device is not None else params[0].device
    total = sum(p.numel() for p in params)
    flat = torch.empty(total, dtype=torch.float32, device=where)
    for p, (start, stop) in zip(params, param_ranges(params), strict=True):
        flat[start:stop].copy_(p.data.reshape(-1))
        p.data = flat[start:stop].view_as(p)
    return flat


class HostMirror:
    """CPU parameters: the host weights are the parameters' own flat buffer (zero copy)."""

    staging_depth = 1

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.device = torch.device("cpu")
        self.flat = flatten_into_views(params, self.device)
        self.ranges = param_ranges(params)
        self.weights = HostBuffer(self.flat)
        self.grads = HostBuffer(torch.zeros_like(self.flat))

    def new_buffer(self) -> HostBuffer:
        return HostBuffer(torch.empty_like(self.flat))

    def gather_grads_in(self, array: np.ndarray) -> bool:
        self.grads = HostBuffer(torch.from_numpy(array))
        return True

    def copy_grad(self, start: int, stop: int, grad: torch.Tensor) -> None:
        self.grads.tensor[start:stop].copy_(grad.reshape(-1))

    def fence(self) -> Fence:
        return DONE

    def upload(self, source: HostBuffer) -> None:
        if source is not self.weights:
            np.copyto(self.weights.array, source.array)


def device_of(params: Sequence[torch.Tensor]) -> torch.device:
    """The one device all ``params`` are on (ConfigError if they are spread over several)."""
    devices = {p.device for p in params}
    if len(devices) != 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ConfigError(f"parameters must all be on one device; found {names}")
    return devices.pop()


def make_mirror(params: Sequence[torch.nn.Parameter]) -> DeviceMirror:
    """The mirror for the device ``params`` are on; re-points them into its flat buffer."""
    device = device_of(params)
    if device.type == "cpu":
        return HostMirror(params)
    if device.type == "cuda":
        from hogshard.worker.cuda import CudaMirror

        return CudaMirror(params, device)
    raise ConfigError(f"parameters are on {device}; PSOptimizer supports cpu and cuda")


def resolve_device(spec: str) -> torch.device:
    """``auto`` (cuda when available, else cpu), ``cpu``, ``cuda`` or ``cuda:N``.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise ConfigError(f"unknown device {spec!r}; use one of {', '.join(DEVICE_CHOICES)}"
                          ) from exc
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {spec!r}: only cpu and cuda are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {spec!r} asked for, but this torch "
                          f"({torch.__version__}) sees no CUDA device")
    return device


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device auto|cpu|cuda[:N]`` on a script's parser; it parses to a ``torch.device``
    (an unusable device is a usage error).

    >>> p = argparse.ArgumentParser(); add_device_argument(p)
    >>> p.parse_args(["--device", "cpu"]).device
    device(type='cpu')
    """
    parser.add_argument("--device", type=_parse_device, default="auto",
                        metavar="{" + ",".join(DEVICE_CHOICES) + "}",
                        help="where the model trains (auto: cuda when available, else cpu)")


def _parse_device(text: str) -> torch.device:
    try:
        return resolve_device(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def host_empty(shape: tuple[int, ...], device: torch.device,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised host tensor to stage data for ``device`` (pinned for CUDA)."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; a copy from pinned memory does not block the CPU."""
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=True)


def to_host(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Numpy arrays of ``tensors`` (views for CPU tensors; CUDA ones are copied into pinned
    memory together and waited for once)."""
    if all(t.device.type == "cpu" for t in tensors):
        return [t.detach().numpy() for t in tensors]
    from hogshard.worker.cuda import download

    return download(tensors)
