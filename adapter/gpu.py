"""GPU buffers: recognising them, describing them to NCCL, and staging them through pinned
host memory for the backends that move host bytes (ring, jaccl, mpi).

Nothing here imports cupy or torch unless the caller already holds one of their arrays
(or asks for a device count), so `import adapter` stays numpy-only.

Two paths for a cupy array or CUDA torch tensor:
  - NCCL reads and writes device memory itself: device_buffer(x) describes x as a
    DeviceBuffer (pointer, element count, numpy dtype, device, stream) and empty_like()
    allocates a result of x's kind on x's device.
  - Host backends get stage_to_host(x), a copy in pinned (page-locked) memory, which the
    GPU fills at full PCIe speed; host_empty() gives a pinned result buffer and
    to_device(out, like) copies a result back next to `like`. Pinned blocks come from a
    pool and return to it when the last numpy view of them is garbage collected.
"""
from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any

import numpy as np

# Device facts live with the NCCL backend (a backend must not import this upper layer).
from .backends.base import DeviceBuffer
from .backends.elements import BFLOAT16, DTYPE_CODES
from .backends.nccl.device import cuda_visible_reason, device_count

__all__ = ["library_of", "is_cuda_array", "array_kind", "cuda_visible_reason", "device_count", "numpy_dtype_of",
           "DeviceBuffer", "device_buffer", "empty_like", "copy_of", "PinnedPool", "pinned_pool", "stage_to_host",
           "host_empty", "to_device"]

# ---- recognising GPU arrays ----------------------------------------------------------------


def library_of(x: Any) -> str:
    """'torch', 'cupy' or 'numpy' (anything else), from the type's module: imports neither library."""
    module = type(x).__module__ or ""
    if module.startswith("torch"):
        return "torch"
    if module.startswith("cupy"):
        return "cupy"
    return "numpy"


def is_cuda_array(x: Any) -> bool:
    """True for a cupy array or a CUDA torch tensor; never imports either library."""
    kind = library_of(x)
    if kind == "cupy":
        return hasattr(type(x), "__cuda_array_interface__")
    if kind == "torch":
        return bool(getattr(x, "is_cuda", False))
    return False


def array_kind(x: Any) -> str:
    """'cupy', 'torch' (CUDA tensor) or 'host' (anything else)."""
    return library_of(x) if is_cuda_array(x) else "host"


# ---- dtypes --------------------------------------------------------------------------------


def numpy_dtype_of(x: Any) -> np.dtype:
    """The numpy dtype (ml_dtypes.bfloat16 for bfloat16) matching a cupy array or torch tensor;
    TypeError for a dtype jacklring does not move (float8, quantised types, ...)."""
    if library_of(x) == "torch":
        name = str(x.dtype).replace("torch.", "")
        dtype = BFLOAT16 if name == "bfloat16" else _named_dtype(name)
    else:
        dtype = np.dtype(x.dtype)
    if dtype not in DTYPE_CODES:
        raise TypeError(f"dtype {x.dtype} is not supported by jacklring "
                        f"(supported: {', '.join(sorted(map(str, DTYPE_CODES)))})")
    return dtype


def _named_dtype(name: str) -> np.dtype | None:
    try:
        return np.dtype(name)
    except TypeError:
        return None


def device_buffer(x: Any) -> DeviceBuffer:
    """Describe a cupy array or CUDA tensor (made contiguous first if it is not)."""
    kind = array_kind(x)
    if kind == "torch":
        import torch

        t = x.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        stream = torch.cuda.current_stream(t.device).cuda_stream
        return DeviceBuffer(t.data_ptr(), t.numel(), numpy_dtype_of(t), t.device.index, int(stream), t)
    if kind == "cupy":
        import cupy

        with x.device:
            a = cupy.ascontiguousarray(x)
            stream = cupy.cuda.get_current_stream().ptr
        return DeviceBuffer(a.data.ptr, a.size, np.dtype(a.dtype), a.device.id, int(stream), a)
    raise TypeError(f"{type(x).__name__} is not a cupy array or CUDA tensor")


def empty_like(x: Any, shape: tuple[int, ...]) -> Any:
    """An uninitialised array of x's kind, dtype and device with the given shape."""
    kind = array_kind(x)
    if kind == "torch":
        import torch

        return torch.empty(shape, dtype=x.dtype, device=x.device)
    if kind == "cupy":
        import cupy

        with x.device:
            return cupy.empty(shape, dtype=x.dtype)
    raise TypeError(f"{type(x).__name__} is not a cupy array or CUDA tensor")


def copy_of(x: Any) -> Any:
    """A contiguous copy of a cupy array or CUDA tensor on its device (broadcast's root buffer)."""
    kind = array_kind(x)
    if kind == "torch":
        import torch

        return x.detach().clone(memory_format=torch.contiguous_format)
    if kind == "cupy":
        with x.device:
            return x.copy(order="C")
    raise TypeError(f"{type(x).__name__} is not a cupy array or CUDA tensor")


# ---- the host path: pinned staging ---------------------------------------------------------


class PinnedPool:
    """Page-locked host blocks by power-of-two size class, reused across operations.

    take() returns a uint8 numpy array over a block; the block goes back to the pool when
    that array and every view of it are garbage collected (a ctypes object per lease carries
    the finalizer, and numpy views keep it alive). At most max_cached_bytes stay cached."""

    MIN_BLOCK = 4096

    def __init__(self, max_cached_bytes: int = 1 << 30, allocate=None) -> None:
        self.max_cached_bytes = max_cached_bytes
        self._allocate = allocate or _allocate_pinned  # (nbytes, library) -> (address, owner)
        self._free: dict[int, list[tuple[int, Any]]] = {}
        self._cached = 0
        self._lock = threading.Lock()
        self.allocations = 0  # blocks ever allocated (tests check reuse)

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(PinnedPool.MIN_BLOCK, 1 << (max(nbytes, 1) - 1).bit_length())

    def take(self, nbytes: int, library: str) -> np.ndarray:
        """A pinned uint8 array of nbytes; library ('torch' or 'cupy') allocates a new block."""
        if nbytes == 0:
            return np.empty(0, np.uint8)
        size = self.size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            block = free.pop() if free else None
            if block is not None:
                self._cached -= size
        if block is None:
            block = self._allocate(size, library)
            self.allocations += 1
        ptr, _keepalive = block
        lease = (ctypes.c_uint8 * nbytes).from_address(ptr)
        weakref.finalize(lease, self._give_back, size, block)
        return np.frombuffer(lease, np.uint8)

    def _give_back(self, size: int, block: tuple[int, Any]) -> None:
        with self._lock:
            if self._cached + size <= self.max_cached_bytes:
                self._free.setdefault(size, []).append(block)
                self._cached += size

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._cached = 0


def _allocate_pinned(nbytes: int, library: str) -> tuple[int, Any]:
    """(address, owner) of a new page-locked block; the owner frees it when collected."""
    if library == "torch":
        import torch

        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return t.data_ptr(), t
    import cupy

    mem = cupy.cuda.alloc_pinned_memory(nbytes)
    return mem.ptr, mem


_pool: PinnedPool | None = None


def pinned_pool() -> PinnedPool:
    """The process's pinned staging pool, sized by JACKLRING_PINNED_CACHE_BYTES on first use."""
    global _pool
    if _pool is None:
        from . import config

        _pool = PinnedPool(config.get("JACKLRING_PINNED_CACHE_BYTES"))
    return _pool


def stage_to_host(x: Any) -> np.ndarray:
    """A copy of GPU array x in pinned host memory, with x's shape and numpy dtype."""
    kind = array_kind(x)
    dtype = numpy_dtype_of(x)
    shape = tuple(x.shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    host = pinned_pool().take(nbytes, kind)
    if nbytes:
        if kind == "torch":
            import torch

            src = x.detach().contiguous().reshape(-1).view(torch.uint8)
            torch.from_numpy(host).copy_(src)  # blocking device-to-host copy
        elif kind == "cupy":
            import cupy

            with x.device:
                src = cupy.ascontiguousarray(x).reshape(-1).view(cupy.uint8)
                src.get(out=host, blocking=True)
        else:
            raise TypeError(f"{type(x).__name__} is not a cupy array or CUDA tensor")
    return host.view(dtype).reshape(shape)


def host_empty(shape: tuple[int, ...], dtype: np.dtype, like: Any) -> np.ndarray:
    """An uninitialised pinned host array for a result that will go back to like's device."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return pinned_pool().take(nbytes, array_kind(like)).view(dtype).reshape(shape)


def to_device(out: np.ndarray, like: Any) -> Any:
    """Copy host result `out` into a new array of like's kind on like's device (out's shape)."""
    out = np.ascontiguousarray(out)
    kind = array_kind(like)
    if kind == "torch":
        import torch

        dev = torch.empty(out.shape, dtype=like.dtype, device=like.device)
        if out.size:
            dev.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(out.reshape(-1).view(np.uint8)))
        return dev
    if kind == "cupy":
        import cupy

        with like.device:
            dev = cupy.empty(out.shape, dtype=out.dtype)
            if out.size:
                dev.set(out)
                cupy.cuda.get_current_stream().synchronize()
        return dev
    raise TypeError(f"{type(like).__name__} is not a cupy array or CUDA tensor")
