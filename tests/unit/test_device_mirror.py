"""The device mirror behind PSOptimizer: on the CPU the host weights are the parameters (no
copy); on each available device gradients reach the host buffer and uploaded weights reach
the parameters; parameters spread over devices are refused; importing and using the worker on
the CPU never initialises CUDA."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from hogshard.proto.errors import ConfigError
from hogshard.worker.device import (
    HostMirror,
    make_mirror,
    resolve_device,
    to_device,
    to_host,
)


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(device)


def _flat_params(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy()


def test_cpu_host_weights_are_the_parameters() -> None:
    model = _model("cpu")
    before = _flat_params(model)
    mirror = make_mirror(list(model.parameters()))
    assert isinstance(mirror, HostMirror)
    np.testing.assert_array_equal(mirror.weights.array, before)
    mirror.weights.array[:] = 0.5  # what a pull does: lands in the model
    assert all(torch.all(p == 0.5) for p in model.parameters())
    assert not np.shares_memory(mirror.grads.array, mirror.weights.array)


def test_mirror_keeps_the_parameters_on_their_device(device: str) -> None:
    model = _model(device)
    before = _flat_params(model)
    params = list(model.parameters())
    mirror = make_mirror(params)
    assert mirror.flat.device.type == device
    assert all(p.device.type == device for p in params)
    assert [stop - start for start, stop in mirror.ranges] == [p.numel() for p in params]
    np.testing.assert_array_equal(mirror.weights.array, before)
    np.testing.assert_array_equal(mirror.flat.cpu().numpy(), before)


def test_gradients_reach_the_host_buffer(device: str) -> None:
    model = _model(device)
    params = list(model.parameters())
    mirror = make_mirror(params)
    model(torch.randn(4, 6, device=device)).square().sum().backward()
    for p, (start, stop) in zip(params, mirror.ranges, strict=True):
        mirror.copy_grad(start, stop, p.grad)
    expected = torch.cat([p.grad.reshape(-1) for p in params]).cpu().numpy()
    mirror.fence().wait()
    np.testing.assert_array_equal(mirror.grads.array, expected)


@pytest.mark.parametrize("source", ["weights", "staging"])
def test_uploaded_weights_are_what_the_model_computes_with(device: str, source: str) -> None:
    model = _model(device)
    mirror = make_mirror(list(model.parameters()))
    buffer = mirror.weights if source == "weights" else mirror.new_buffer()
    target = np.arange(mirror.flat.numel(), dtype=np.float32) / 100
    buffer.writable()[:] = target
    mirror.upload(buffer)
    np.testing.assert_array_equal(_flat_params(model), target)
    x = torch.ones(1, 6, device=device)
    reference = _model("cpu")
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(torch.from_numpy(target), reference.parameters())
        np.testing.assert_allclose(model(x).cpu().numpy(), reference(x.cpu()).numpy(),
                                   rtol=1e-6, atol=1e-6)
    if source == "staging":  # once the copy is done the buffer may be written again
        buffer.writable()[:] = 0.0
        np.testing.assert_array_equal(_flat_params(model), target)


def test_parameters_on_several_devices_or_an_unsupported_one_are_refused() -> None:
    cpu = nn.Parameter(torch.zeros(3))
    meta = nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(ConfigError, match="one device"):
        make_mirror([cpu, meta])
    with pytest.raises(ConfigError, match="supports cpu and cuda"):
        make_mirror([meta])


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    auto = resolve_device("auto")
    assert auto.type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="only cpu and cuda"):
        resolve_device("meta")
    with pytest.raises(ConfigError, match="unknown device"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")


def test_to_device_and_to_host_round_trip(device: str) -> None:
    target = torch.device(device)
    host = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    on_device = to_device(host, target)
    assert on_device.device.type == device
    assert to_device(on_device, on_device.device) is on_device
    (back,) = to_host([on_device * 2])
    np.testing.assert_array_equal(back, host.numpy() * 2)


NO_CUDA_INIT = """
import sys
import torch
import hogshard.worker.optimizer, hogshard.worker.embedding, hogshard.worker.overlap
from hogshard.worker.device import make_mirror
from hogshard.worker.overlap import GradientBuckets
from hogshard.proto.tables import Chunk
model = torch.nn.Linear(4, 2)
params = list(model.parameters())
mirror = make_mirror(params)
GradientBuckets(params, [Chunk(0, 0, 10, 0)], mirror, lambda chunks: None)
model(torch.randn(3, 4)).sum().backward()
print("cuda initialised:", torch.cuda.is_initialized())
sys.exit(1 if torch.cuda.is_initialized() else 0)
"""


def test_the_cpu_worker_never_initialises_cuda() -> None:
    done = subprocess.run([sys.executable, "-c", NO_CUDA_INIT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cuda initialised: False" in done.stdout
