"""NCCL with world size 1 on a real GPU: every op, host (numpy) and device (cupy, CUDA torch)
buffers, every dtype plan (native, widened, bool, complex), split both ways, and cupy's NCCL
constants against the table in nccl_types."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_common import nccl_world_of_one, needs_gpu, require_cupy
from ranks import free_ports

from adapter import gpu
from adapter.backends.base import ReduceOp
from adapter.backends.elements import BFLOAT16
from adapter.backends.nccl import types as nccl_types

pytestmark = [needs_gpu, pytest.mark.timeout(120)]
cupy = None


@pytest.fixture(scope="module", autouse=True)
def _cupy():
    global cupy
    cupy = require_cupy()


@pytest.fixture(scope="module")
def comm():
    backend = nccl_world_of_one(free_ports(1)[0])
    yield backend
    backend.close()


def test_enum_table_matches_cupy():
    from cupy.cuda import nccl

    for name in ("INT8", "UINT8", "INT32", "UINT32", "INT64", "UINT64", "FLOAT16", "FLOAT32", "FLOAT64",
                 "BFLOAT16", "SUM", "PROD", "MAX", "MIN"):
        assert getattr(nccl_types, f"NCCL_{name}") == getattr(nccl, f"NCCL_{name}"), name


DTYPES = [np.float32, np.float64, np.float16, BFLOAT16, np.int8, np.uint8, np.int16, np.uint16, np.int32,
          np.uint32, np.int64, np.uint64, np.bool_, np.complex64, np.complex128]


def sample(dtype, n=1000):
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return np.arange(n) % 3 == 0
    if dt.kind == "c":
        return (np.arange(n) + 1j * np.arange(n)[::-1]).astype(dt)
    return (np.arange(n) % 100).astype(dt)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX, ReduceOp.MIN])
def test_all_reduce_host_buffers(comm, dtype, op):
    src = sample(dtype)
    try:
        nccl_types.reduce_plan(src.dtype, op)
    except TypeError:
        with pytest.raises(TypeError, match=op.name):
            comm.all_reduce(src, np.empty_like(src), op)
        return
    dst = np.empty_like(src)
    comm.all_reduce(src, dst, op)
    assert np.array_equal(dst, src)  # one rank: the reduction of one contribution is itself


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int16, np.bool_, np.complex64], ids=str)
def test_all_reduce_cupy_in_place_on_device(comm, dtype):
    x = cupy.asarray(sample(dtype))
    before = x.copy()
    buf = gpu.device_buffer(x)
    comm.all_reduce(buf, buf, ReduceOp.SUM)
    assert bool((x == before).all())


def test_bitwise_is_refused_naming_the_op(comm):
    x = np.arange(8, dtype=np.int32)
    with pytest.raises(TypeError, match="NCCL has no BXOR reduction"):
        comm.all_reduce(x, np.empty_like(x), ReduceOp.BXOR)


def test_all_gather_reduce_scatter_broadcast_barrier(comm):
    src = np.arange(64, dtype=np.float32)
    dst = np.empty_like(src)
    comm.all_gather(src, dst)
    assert np.array_equal(dst, src)
    comm.reduce_scatter(src, dst, ReduceOp.MAX)
    assert np.array_equal(dst, src)
    b = np.arange(10, dtype=np.int64)
    comm.broadcast(b, 0)
    assert np.array_equal(b, np.arange(10))
    comm.barrier()
    x = cupy.arange(32, dtype=cupy.float32)
    out = cupy.empty_like(x)
    comm.all_gather(gpu.device_buffer(x), gpu.device_buffer(out))
    assert bool((out == x).all())


def test_sendrecv_to_itself(comm):
    src = np.arange(100, dtype=np.float64)
    dst = np.zeros_like(src)
    comm.sendrecv(src, 0, dst, 0)
    assert np.array_equal(dst, src)
    x = cupy.arange(7, dtype=cupy.int32)
    y = cupy.zeros_like(x)
    comm.sendrecv(gpu.device_buffer(x), 0, gpu.device_buffer(y), 0)
    assert bool((x == y).all())


def test_torch_cuda_tensors_including_bfloat16(comm):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch in this environment has no CUDA")
    for dtype in (torch.float32, torch.bfloat16, torch.int16):
        t = torch.arange(50, device="cuda:0").to(dtype)
        out = torch.empty_like(t)
        comm.all_reduce(gpu.device_buffer(t), gpu.device_buffer(out), ReduceOp.MAX)
        torch.cuda.synchronize()
        assert torch.equal(out, t), dtype


@pytest.mark.parametrize("way", ["commSplit", "bootstrap"])
def test_split(comm, monkeypatch, way):
    if way == "bootstrap":
        monkeypatch.setenv("JACKLRING_NCCL_SPLIT", "bootstrap")
    sub = comm.split(3, 0)
    try:
        assert (sub.rank(), sub.size()) == (0, 1)
        x = np.arange(5, dtype=np.float32)
        y = np.empty_like(x)
        sub.all_reduce(x, y, ReduceOp.SUM)
        assert np.array_equal(x, y)
    finally:
        sub.close()


def test_ops_layer_passes_cupy_through_a_group_of_one(comm):
    import adapter
    from adapter.group import Group

    x = cupy.arange(6, dtype=cupy.float32)
    y = adapter.all_sum(x, group=Group(comm))
    assert isinstance(y, cupy.ndarray) and bool((y == x).all())
