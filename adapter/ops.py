"""The collectives a training script calls, mirroring mlx.core.distributed.

Each op accepts a numpy array, a torch tensor or a cupy array and returns the same kind.
In a group of size 1 every collective returns its input unchanged.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import gpu
from .arrays import as_numpy, flat, numpy_dtype, result_like
from .backends.base import ReduceOp
from .backends.elements import DTYPE_CODES, check_reducible, dtype_code
from .group import Group, default_group


def _on_device(g: Group, x: Any) -> bool:
    """A GPU buffer headed for a backend that reads device memory itself (NCCL): no staging."""
    return getattr(g.backend, "takes_device_buffers", False) and gpu.is_cuda_array(x)


# The (dtype, op) pairs every check of the general path accepts for a native numpy array.
_REDUCIBLE: set[tuple[np.dtype, ReduceOp]] = set()
for _dt in DTYPE_CODES:
    for _op in ReduceOp:
        try:
            check_reducible(_dt, _op)
        except TypeError:
            continue
        _REDUCIBLE.add((_dt, _op))


def _all_reduce(x: Any, op: ReduceOp, group: Group | None) -> Any:
    g = default_group(group)
    backend = g.backend
    if backend.size() == 1:
        return x
    if type(x) is np.ndarray and x.flags.c_contiguous and (x.dtype, op) in _REDUCIBLE:
        # The common case, checked in one look-up: a C-contiguous numpy array of a native
        # supported dtype (a big-endian one is not in the set) with an op defined for it.
        out = np.empty(x.shape, x.dtype)
        if x.ndim == 1:
            backend.all_reduce(x, out, op)
        else:
            backend.all_reduce(x.reshape(-1), out.reshape(-1), op)
        return out
    if _on_device(g, x):
        check_reducible(gpu.numpy_dtype_of(x), op)
        out = gpu.empty_like(x, tuple(x.shape))
        g.backend.all_reduce(gpu.device_buffer(x), gpu.device_buffer(out), op)
        return out
    arr, restore = as_numpy(x)
    check_reducible(arr.dtype, op)
    out = np.empty(arr.shape, arr.dtype)
    g.backend.all_reduce(flat(arr), flat(out), op)
    return restore(out)


def all_sum(x: Any, *, group: Group | None = None) -> Any:
    """Elementwise sum of x over every rank of the group."""
    return _all_reduce(x, ReduceOp.SUM, group)


def all_max(x: Any, *, group: Group | None = None) -> Any:
    """Elementwise maximum of x over every rank of the group."""
    return _all_reduce(x, ReduceOp.MAX, group)


def all_min(x: Any, *, group: Group | None = None) -> Any:
    """Elementwise minimum of x over every rank of the group."""
    return _all_reduce(x, ReduceOp.MIN, group)


def all_reduce(x: Any, op: ReduceOp | str = ReduceOp.SUM, *, group: Group | None = None) -> Any:
    """all_sum / all_max / all_min generalised to every ReduceOp (prod, band, bor, bxor)."""
    return _all_reduce(x, _reduce_op(op), group)


def _reduce_op(op: ReduceOp | str) -> ReduceOp:
    """A ReduceOp from itself or its name in any case ("sum", "SUM"); ValueError naming the choices."""
    if isinstance(op, ReduceOp):
        return op
    try:
        return ReduceOp(str(op).lower())
    except ValueError:
        raise ValueError(f"unknown reduce op {op!r}; choose one of {', '.join(o.value for o in ReduceOp)}") from None


def all_gather(x: Any, *, group: Group | None = None) -> Any:
    """Every rank's x concatenated along axis 0, in rank order (a scalar counts as shape (1,))."""
    g = default_group(group)
    if g.size() == 1:
        return x
    if _on_device(g, x):
        x = x.reshape(1) if x.ndim == 0 else x
        out = gpu.empty_like(x, (g.size() * x.shape[0],) + tuple(x.shape[1:]))
        g.backend.all_gather(gpu.device_buffer(x), gpu.device_buffer(out))
        return out
    arr, restore = as_numpy(x)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    out = np.empty((g.size() * arr.shape[0],) + arr.shape[1:], arr.dtype)
    g.backend.all_gather(flat(arr), flat(out))
    return restore(out)


def sum_scatter(x: Any, *, group: Group | None = None) -> Any:
    """Sum x over ranks and return this rank's block of the first axis (which size() must divide)."""
    return _reduce_scatter(x, ReduceOp.SUM, group)


def _reduce_scatter(x: Any, op: ReduceOp, group: Group | None) -> Any:
    g = default_group(group)
    if g.size() == 1:
        return x
    n = g.size()
    shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)  # arrays, tensors, or lists
    if len(shape) == 0 or shape[0] % n != 0:
        raise ValueError(
            f"sum_scatter: the first dimension of shape {shape} must be divisible by the group size {n}"
        )
    if _on_device(g, x):
        check_reducible(gpu.numpy_dtype_of(x), op)
        out = gpu.empty_like(x, (shape[0] // n,) + shape[1:])
        g.backend.reduce_scatter(gpu.device_buffer(x), gpu.device_buffer(out), op)
        return out
    arr, restore = as_numpy(x)
    check_reducible(arr.dtype, op)
    out = np.empty((arr.shape[0] // n,) + arr.shape[1:], arr.dtype)
    g.backend.reduce_scatter(flat(arr), flat(out), op)
    return restore(out)


def reduce_scatter(x: Any, op: ReduceOp | str = ReduceOp.SUM, *, group: Group | None = None) -> Any:
    """sum_scatter generalised to every ReduceOp."""
    return _reduce_scatter(x, _reduce_op(op), group)


def broadcast(x: Any, root: int = 0, *, group: Group | None = None) -> Any:
    """root's x on every rank (every rank passes an array of the same shape and dtype)."""
    g = default_group(group)
    _check_peer(g, root, "broadcast root")
    if g.size() == 1:
        return x
    if _on_device(g, x):
        buf = gpu.copy_of(x) if g.rank() == root else gpu.empty_like(x, tuple(x.shape))
        g.backend.broadcast(gpu.device_buffer(buf), root)
        return buf
    arr, restore = as_numpy(x)
    out = np.array(arr, copy=True, order="C") if g.rank() == root else np.empty(arr.shape, arr.dtype)
    g.backend.broadcast(flat(out), root)
    return restore(out)


def barrier(*, group: Group | None = None) -> None:
    """Return once every rank of the group has entered the barrier."""
    g = default_group(group)
    if g.size() > 1:
        g.backend.barrier()


def send(x: Any, dst: int, *, group: Group | None = None) -> Any:
    """Send x to rank dst; returns x."""
    g = default_group(group)
    _check_peer(g, dst, "send destination")
    if _on_device(g, x):
        g.backend.send(gpu.device_buffer(x), dst)
        return x
    arr, _ = as_numpy(x)
    g.backend.send(flat(arr), dst)
    return x


def recv(shape: Sequence[int], dtype: Any, src: int, *, group: Group | None = None) -> Any:
    """Receive an array of the given shape and dtype from rank src."""
    g = default_group(group)
    _check_peer(g, src, "recv source")
    dtype_code(numpy_dtype(dtype))  # an unsupported dtype is refused before any byte is read
    out = np.empty((int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape), numpy_dtype(dtype))
    g.backend.recv(flat(out), src)
    return result_like(dtype)(out)


def recv_like(x: Any, src: int, *, group: Group | None = None) -> Any:
    """Receive an array shaped and typed like x from rank src, of x's kind."""
    g = default_group(group)
    _check_peer(g, src, "recv source")
    if _on_device(g, x):
        out = gpu.empty_like(x, tuple(x.shape))
        g.backend.recv(gpu.device_buffer(out), src)
        return out
    arr, restore = as_numpy(x)
    out = np.empty(arr.shape, arr.dtype)
    g.backend.recv(flat(out), src)
    return restore(out)


def _check_peer(g: Group, peer: int, what: str) -> None:
    if not 0 <= peer < g.size():
        raise ValueError(f"{what} {peer} is out of range for a group of size {g.size()} (rank {g.rank()})")
    if what != "broadcast root" and peer == g.rank():
        raise ValueError(f"{what} {peer} is this rank itself")
