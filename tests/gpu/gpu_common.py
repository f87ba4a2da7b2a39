"""Shared by the GPU tests: the skip marker naming the missing device, and a world of one."""
from __future__ import annotations

import os

import pytest

from adapter.backends.nccl.device import cuda_visible_reason, device_count

_COUNT = device_count()


def _reason() -> str:
    why = cuda_visible_reason()
    if why is not None:
        return f"needs a CUDA device: {why}"
    return "needs a CUDA device: none usable (cupy and torch both report 0 CUDA devices)"


needs_gpu = pytest.mark.skipif(_COUNT < 1, reason=_reason() if _COUNT < 1 else "")
needs_two_gpus = pytest.mark.skipif(_COUNT < 2, reason=f"needs 2 CUDA devices, {_COUNT} visible")


def require_cupy():
    """cupy, or a failure: on a machine with a GPU a missing cupy is a broken setup, not a skip."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as exc:
        pytest.fail(f"cupy with NCCL is not importable ({exc}); scripts/gpu_check.sh installs "
                    f"cupy-cuda12x and nvidia-nccl-cu12")
    if not nccl.available:
        pytest.fail("cupy cannot load libnccl; pip install nvidia-nccl-cu12")
    return cupy


def nccl_world_of_one(port: int):
    """An NCCL communicator of one rank built through the real environment contract."""
    from adapter.backends.nccl import backend as nccl

    env = {"MLX_RANK": "0", "MLX_WORLD_SIZE": "1", "NCCL_HOST_IP": "127.0.0.1", "NCCL_PORT": str(port)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        assert nccl.probe() is None, nccl.probe()
        return nccl.create(timeout=60)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
