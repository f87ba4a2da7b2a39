"""adapter.gpu on a real GPU: detection, device buffers, and the pinned staging round trip
that ring / jaccl / mpi use for cupy arrays and CUDA tensors."""
from __future__ import annotations

import gc

import numpy as np
import pytest
from gpu_common import needs_gpu, require_cupy

from adapter import gpu
from adapter.backends.elements import BFLOAT16

pytestmark = [needs_gpu, pytest.mark.timeout(120)]


def _pinned(arr: np.ndarray) -> bool:
    import cupy

    attrs = cupy.cuda.runtime.pointerGetAttributes(arr.ctypes.data)
    return attrs.type == cupy.cuda.runtime.memoryTypeHost


def test_cupy_round_trip_through_pinned_memory():
    cupy = require_cupy()
    assert gpu.device_count() >= 1
    x = cupy.arange(24, dtype=cupy.float32).reshape(4, 6)[:, ::2]  # not contiguous
    assert gpu.is_cuda_array(x) and gpu.array_kind(x) == "cupy"
    host = gpu.stage_to_host(x)
    assert host.shape == (4, 3) and _pinned(host)
    assert np.array_equal(host, cupy.asnumpy(x))
    back = gpu.to_device(host * 2, x)
    assert isinstance(back, cupy.ndarray) and back.device.id == x.device.id
    assert bool((back == x * 2).all())
    out = gpu.host_empty((5,), np.int64, x)
    assert _pinned(out)


def test_pool_reuses_pinned_blocks():
    cupy = require_cupy()
    pool = gpu.pinned_pool()
    x = cupy.ones(1000, dtype=cupy.float64)
    gpu.stage_to_host(x)
    gc.collect()
    before = pool.allocations
    for _ in range(5):
        gpu.stage_to_host(x)
        gc.collect()
    assert pool.allocations == before


def test_torch_cuda_round_trip_including_bfloat16_and_scalars():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch in this environment has no CUDA")
    for dtype in (torch.float32, torch.bfloat16, torch.int16, torch.bool, torch.complex64):
        t = torch.arange(12, device="cuda:0").to(dtype).reshape(3, 4).t()  # not contiguous
        assert gpu.is_cuda_array(t)
        host = gpu.stage_to_host(t)
        assert host.shape == (4, 3)
        if dtype == torch.bfloat16:
            assert host.dtype == BFLOAT16
        back = gpu.to_device(host, t)
        assert back.device == t.device and back.dtype == t.dtype and torch.equal(back, t)
    scalar = torch.tensor(3.5, device="cuda:0")
    assert gpu.stage_to_host(scalar).shape == ()
    empty = torch.empty(0, device="cuda:0")
    assert gpu.to_device(gpu.stage_to_host(empty), empty).shape == (0,)
    buf = gpu.device_buffer(torch.ones(10, device="cuda:0", dtype=torch.bfloat16))
    assert (buf.count, buf.dtype, buf.device, buf.nbytes) == (10, BFLOAT16, 0, 20)
