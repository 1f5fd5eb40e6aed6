"""The CUDA side of :mod:`hogshard.worker.device`: pinned host buffers, copies on side streams.

Two side streams per mirror, one per direction, so gradient copies (device -> host) and weight
copies (host -> device) can run at once on the GPU's copy engines and beside its kernels:

- ``copy_grad`` (called from a parameter's post-accumulate hook) makes the gradient stream
  wait for the model's stream, then queues the copy into the pinned gradient buffer (the
  client's shared-memory segment, registered as pinned, when a server of this host takes the
  table's pushes through it: the push then copies nothing on the host); the
  gradient's memory is marked as used by that stream, so freeing it (``zero_grad``) before the
  copy ends is safe. ``fence`` records an event there: a bucket is pushed once it is passed.
- ``upload`` waits (on the GPU) for the model's earlier kernels, queues the copy of the pinned
  weights into the flat buffer, and makes the model's stream wait for it: the next forward is
  ordered after the copy by an event, the CPU does not block. The source buffer stays ``busy``
  until the copy is done, and is not written before (:meth:`HostBuffer.writable`).

Nothing in this module runs at import; CUDA is initialised by the first ``CudaMirror``.

Example (what :func:`hogshard.worker.device.make_mirror` returns for a CUDA model)::

    mirror = CudaMirror(list(model.parameters()), torch.device("cuda"))
    mirror.upload(mirror.weights)        # after a pull landed in mirror.weights.array
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from hogshard.worker.device import Fence, HostBuffer, flatten_into_views, param_ranges

log = logging.getLogger(__name__)


class EventFence:
    """A recorded CUDA event as a :class:`~hogshard.worker.device.Fence`."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._event = torch.cuda.Event()
        self._event.record(stream)

    def ready(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> None:
        self._event.synchronize()


class CudaMirror:
    """CUDA parameters with pinned host mirrors of the flat weights and gradients."""

    staging_depth = 2  # a prefetch lands in one buffer while the last one is still uploading

    def __init__(self, params: Sequence[torch.nn.Parameter], device: torch.device) -> None:
        self.device = device
        self.flat = flatten_into_views(params, device)
        self.ranges = param_ranges(params)
        self._grad_stream = torch.cuda.Stream(device)
        self._weight_stream = torch.cuda.Stream(device)
        self.weights = self.new_buffer()
        self.weights.tensor.copy_(self.flat)  # blocking: the initial weights, for rank 0's init
        self.grads = self.new_buffer()
        self.grads.tensor.zero_()

    def new_buffer(self) -> HostBuffer:
        return HostBuffer(torch.empty(self.flat.numel(), dtype=torch.float32, pin_memory=True))

    def gather_grads_in(self, array: np.ndarray) -> bool:
        """Copy gradients from the device straight into ``array`` (the client's shared-memory
        gradient buffer) from now on, once CUDA has registered its pages as pinned; False,
        and the pinned buffer kept, where CUDA refuses."""
        tensor = torch.from_numpy(array)
        cudart = torch.cuda.cudart()
        status = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * 4, 0)
        if status != cudart.cudaError.success:
            log.info("gradients stay in a pinned buffer: CUDA did not register the shared "
                     "gradient buffer (%s)", cudart.cudaGetErrorString(status))
            try:  # the runtime keeps the error for the next launch check to report: take it
                torch.zeros(1, device=self.device).add_(1)
            except RuntimeError:
                pass
            return False
        # the pages stay registered while this mirror lives (a process's exit frees them)
        weakref.finalize(self, cudart.cudaHostUnregister, tensor.data_ptr()).atexit = False
        self.grads = HostBuffer(tensor)
        return True

    def copy_grad(self, start: int, stop: int, grad: torch.Tensor) -> None:
        stream = self._grad_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.grads.tensor[start:stop].copy_(grad.reshape(-1), non_blocking=True)
        grad.record_stream(stream)

    def fence(self) -> Fence:
        return EventFence(self._grad_stream)

    def upload(self, source: HostBuffer) -> None:
        model_stream = torch.cuda.current_stream(self.device)
        stream = self._weight_stream
        stream.wait_stream(model_stream)  # kernels still reading the old weights come first
        with torch.cuda.stream(stream):
            self.flat.copy_(source.tensor, non_blocking=True)
        source.busy = EventFence(stream)
        model_stream.wait_stream(stream)


def download(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Copy device tensors into pinned host memory, all queued before one wait per device."""
    outs: list[torch.Tensor] = []
    streams: dict[torch.device, torch.cuda.Stream] = {}
    for t in tensors:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
        out.copy_(t.detach(), non_blocking=True)
        outs.append(out)
        if t.device.type == "cuda":
            streams.setdefault(t.device, torch.cuda.current_stream(t.device))
    for stream in streams.values():
        EventFence(stream).wait()
    return [out.numpy() for out in outs]
