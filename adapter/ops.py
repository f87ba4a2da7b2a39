"""The collectives a training script calls, mirroring mlx.core.distributed.

Each op accepts a numpy array, a torch tensor or a cupy array and returns the same kind.
In a group of size 1 every collective returns its input unchanged.

The collectives that return an array also take `out=`: a writable C-contiguous numpy array
(or CPU torch tensor) of the result's shape and dtype, written and returned instead of a new
array; `out=x` works in place where the result has x's shape (all_reduce family, broadcast).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from . import gpu
from . import group as groups
from .arrays import as_numpy, call_view, flat, numpy_dtype, out_view, plain_cpu_tensor_view, plain_tensor_over, result_like
from .backends.base import ReduceOp
from .backends.elements import DTYPE_CODES, check_reducible, dtype_code
from .backends.local.segment import OP_CODES
from .group import Group, default_group

# The engine's op codes of the reductions that take the fast path (Group.fast, csrc/python/shell.c).
_SUM, _MAX, _MIN = OP_CODES[ReduceOp.SUM], OP_CODES[ReduceOp.MAX], OP_CODES[ReduceOp.MIN]


def _fast(group: Group | None) -> object | None:
    """The engine's one-call path of the group (Group.fast, csrc/python/shell.c), or None. Each
    collective tries it first; NotImplemented from it means the call is not its case, and the
    Python path below runs and words any error."""
    g = groups.first if group is None else group
    return g.fast if type(g) is Group else None


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


def _checked_out(g: Group, what: str, out: Any, shape: tuple, dtype: np.dtype, source: np.ndarray) -> np.ndarray:
    """The numpy view of out=, refused unless it can take the result as it is: the result's
    shape and dtype, C-contiguous, writable, and either x itself or memory apart from it."""
    arr = out_view(out)
    if arr is None:
        raise TypeError(f"rank {g.rank()}: {what}: out= must be a numpy array or a CPU torch tensor, "
                        f"got {type(out).__name__}")
    problems = []
    if tuple(arr.shape) != tuple(shape):
        problems.append(f"shape {tuple(arr.shape)}")
    if arr.dtype != dtype:
        problems.append(f"dtype {arr.dtype}")
    if not arr.flags.c_contiguous:
        problems.append("not C-contiguous")
    if not arr.flags.writeable:
        problems.append("read-only")
    if problems:
        raise ValueError(f"rank {g.rank()}: {what}: out= must be a writable C-contiguous array of shape "
                         f"{tuple(shape)} and dtype {dtype}, got {', '.join(problems)}")
    if arr.size and np.may_share_memory(arr, source) and not _same_memory(arr, source):
        raise ValueError(f"rank {g.rank()}: {what}: out= overlaps the input without being it; pass out=x "
                         f"for in place or a separate array")
    return arr


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.nbytes == b.nbytes


def _copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    if not _same_memory(dst, src):
        flat(dst)[...] = flat(src)


def _no_device_out(g: Group, what: str, out: Any) -> None:
    if out is not None:
        raise TypeError(f"rank {g.rank()}: {what}: out= is not supported for GPU buffers on the {g.backend.name} backend")


def _all_reduce(x: Any, op: ReduceOp, group: Group | None, out: Any = None, what: str = "all_reduce") -> Any:
    g = default_group(group)
    backend = g.backend
    if out is not None:
        if out is x and type(x) is np.ndarray and (x.dtype, op) in _REDUCIBLE:
            flags = x.flags
            if flags.c_contiguous and flags.writeable:
                # In place (out=x) on a C-contiguous array of a native supported dtype: every
                # check of out= holds, so none is made (the hottest call, kept to one frame here).
                if backend.size() > 1:
                    whole = x if x.ndim == 1 else x.reshape(-1)
                    backend.all_reduce(whole, whole, op)
                return out
        return _all_reduce_into(g, x, op, out, what)
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
    arr = plain_cpu_tensor_view(x)
    if arr is not None and (arr.dtype, op) in _REDUCIBLE:
        # A plain contiguous CPU tensor: its numpy view and a tensor over the result, no more.
        out = np.empty(arr.shape, arr.dtype)
        _reduce_views(g, arr.reshape(-1), out.reshape(-1), op)
        return plain_tensor_over(out)
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


def _reduce_views(g: Group, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
    """backend.all_reduce of two numpy arrays (views of tensors, say) that every check already
    accepted, through the engine's one-call path where the group has it."""
    fast = g.fast if type(g) is Group else None
    if fast is None or fast.all_reduce(src, dst, OP_CODES[op]) is NotImplemented:  # type: ignore[attr-defined]
        g.backend.all_reduce(src, dst, op)


def _plain_into(g: Group, src: np.ndarray, dst: np.ndarray | None, op: ReduceOp) -> bool:
    """The common out= call, done: src a C-contiguous array of a native (dtype, op) pair the
    checks accept, dst a writable C-contiguous array of its shape and dtype in memory apart from
    it. Every check of the general path holds then, so none of its messages can be due; False
    (nothing done) for anything else."""
    if (dst is None or dst.shape != src.shape or dst.dtype != src.dtype or (src.dtype, op) not in _REDUCIBLE
            or not (src.flags.c_contiguous and dst.flags.c_contiguous and dst.flags.writeable)):
        return False
    # may_share_memory compares the arrays' memory bounds only, ten times cheaper than reading
    # two addresses through ndarray.ctypes
    if np.may_share_memory(src, dst):
        return False  # overlapping without being one array: the general path says so
    if g.size() > 1:
        if src.ndim != 1:
            src, dst = src.reshape(-1), dst.reshape(-1)
        g.backend.all_reduce(src, dst, op)
    else:
        dst[...] = src
    return True


def _plain_tensors_into(g: Group, x: Any, src: np.ndarray, out: Any, op: ReduceOp) -> bool:
    """_plain_into for a plain CPU tensor x (src: its call_view) and a tensor out: the tensors'
    shapes and addresses are read from them, which costs far less than from numpy views."""
    dst = call_view(out)
    if dst is None or dst.dtype != src.dtype or out.shape != x.shape or (src.dtype, op) not in _REDUCIBLE:
        return False
    lo, hi = x.data_ptr(), out.data_ptr()
    if not (lo + src.nbytes <= hi or hi + dst.nbytes <= lo):
        return False  # overlapping without being one tensor: the general path says so
    if g.size() > 1:
        _reduce_views(g, src, dst, op)
    else:
        dst[...] = src
    return True


def _all_reduce_into(g: Group, x: Any, op: ReduceOp, out: Any, what: str) -> Any:
    if type(x) is np.ndarray:
        if out is x and (x.dtype, op) in _REDUCIBLE and x.flags.c_contiguous and x.flags.writeable:
            # In place (out=x) on a C-contiguous array of a native supported dtype: every check
            # of out= holds, so none is made.
            if g.size() > 1:
                whole = x if x.ndim == 1 else x.reshape(-1)
                g.backend.all_reduce(whole, whole, op)
            return out
        if type(out) is np.ndarray and _plain_into(g, x, out, op):
            return out
        arr = x if x.flags.c_contiguous and x.dtype.isnative else as_numpy(x)[0]
    else:
        view = call_view(x)  # a plain CPU tensor's 1-D view in a few attribute reads, for this call
        if view is not None:
            if out is x and (view.dtype, op) in _REDUCIBLE:
                # In place on a plain tensor: out= is x's own memory, so every check of out= holds.
                if g.size() > 1:
                    _reduce_views(g, view, view, op)
                return out
            if _plain_tensors_into(g, x, view, out, op):
                return out  # plain tensors in and out (tensor parallelism's call)
        arr = plain_cpu_tensor_view(x)
        if arr is None:
            if _on_device(g, x):
                _no_device_out(g, what, out)
            arr = as_numpy(x)[0]
    check_reducible(arr.dtype, op)
    dst = _checked_out(g, what, out, arr.shape, arr.dtype, arr)
    if g.size() == 1:
        _copy_into(dst, arr)
    else:
        g.backend.all_reduce(flat(arr), flat(dst), op)
    return out


def all_sum(x: Any, *, group: Group | None = None, out: Any = None) -> Any:
    """Elementwise sum of x over every rank of the group (into out= when given)."""
    # The hottest call: a numpy array (or a plain torch CPU tensor) of a group whose backend has
    # the engine's one-call path runs there (NotImplemented: not its case, the Python path below runs and words any error).
    g = groups.first if group is None else group
    if type(g) is Group and g.fast is not None:
        done = g.fast.all_reduce(x, out, _SUM)  # type: ignore[attr-defined]
        if done is not NotImplemented:
            return done
    return _all_reduce(x, ReduceOp.SUM, group, out, "all_sum")


def all_max(x: Any, *, group: Group | None = None, out: Any = None) -> Any:
    """Elementwise maximum of x over every rank of the group (into out= when given)."""
    g = groups.first if group is None else group
    if type(g) is Group and g.fast is not None:
        done = g.fast.all_reduce(x, out, _MAX)  # type: ignore[attr-defined]
        if done is not NotImplemented:
            return done
    return _all_reduce(x, ReduceOp.MAX, group, out, "all_max")


def all_min(x: Any, *, group: Group | None = None, out: Any = None) -> Any:
    """Elementwise minimum of x over every rank of the group (into out= when given)."""
    g = groups.first if group is None else group
    if type(g) is Group and g.fast is not None:
        done = g.fast.all_reduce(x, out, _MIN)  # type: ignore[attr-defined]
        if done is not NotImplemented:
            return done
    return _all_reduce(x, ReduceOp.MIN, group, out, "all_min")


def all_reduce(x: Any, op: ReduceOp | str = ReduceOp.SUM, *, group: Group | None = None, out: Any = None) -> Any:
    """all_sum / all_max / all_min generalised to every ReduceOp (prod, band, bor, bxor)."""
    return _all_reduce(x, _reduce_op(op), group, out, "all_reduce")


def _reduce_op(op: ReduceOp | str) -> ReduceOp:
    """A ReduceOp from itself or its name in any case ("sum", "SUM"); ValueError naming the choices."""
    if isinstance(op, ReduceOp):
        return op
    try:
        return ReduceOp(str(op).lower())
    except ValueError:
        raise ValueError(f"unknown reduce op {op!r}; choose one of {', '.join(o.value for o in ReduceOp)}") from None


def all_gather(x: Any, *, group: Group | None = None, out: Any = None) -> Any:
    """Every rank's x concatenated along axis 0, in rank order (a scalar counts as shape (1,));
    into out= (of shape (size * x.shape[0], *x.shape[1:])) when given."""
    fast = _fast(group)
    if fast is not None:
        done = fast.all_gather(x, out)  # type: ignore[attr-defined]
        if done is not NotImplemented:
            return done
    g = default_group(group)
    if out is not None:
        if _on_device(g, x):
            _no_device_out(g, "all_gather", out)
        arr = as_numpy(x)[0]
        arr = arr.reshape(1) if arr.ndim == 0 else arr
        dst = _checked_out(g, "all_gather", out, (g.size() * arr.shape[0],) + arr.shape[1:], arr.dtype, arr)
        if g.size() == 1:
            _copy_into(dst, arr)
        else:
            g.backend.all_gather(flat(arr), flat(dst))
        return out
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


def sum_scatter(x: Any, *, group: Group | None = None, out: Any = None) -> Any:
    """Sum x over ranks and return this rank's block of the first axis (which size() must divide);
    into out= (of shape (x.shape[0] // size, *x.shape[1:])) when given."""
    fast = _fast(group)
    if fast is not None:
        done = fast.reduce_scatter(x, out, _SUM)  # type: ignore[attr-defined]
        if done is not NotImplemented:
            return done
    return _reduce_scatter(x, ReduceOp.SUM, group, out, "sum_scatter")


def _reduce_scatter(x: Any, op: ReduceOp, group: Group | None, out: Any = None, what: str = "reduce_scatter") -> Any:
    g = default_group(group)
    if g.size() == 1 and out is None:
        return x
    n = g.size()
    shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)  # arrays, tensors, or lists
    if len(shape) == 0 or shape[0] % n != 0:
        raise ValueError(
            f"sum_scatter: the first dimension of shape {shape} must be divisible by the group size {n}"
        )
    if _on_device(g, x):
        _no_device_out(g, what, out)
        check_reducible(gpu.numpy_dtype_of(x), op)
        out = gpu.empty_like(x, (shape[0] // n,) + shape[1:])
        g.backend.reduce_scatter(gpu.device_buffer(x), gpu.device_buffer(out), op)
        return out
    arr, restore = as_numpy(x)
    check_reducible(arr.dtype, op)
    if out is not None:
        dst = _checked_out(g, what, out, (arr.shape[0] // n,) + arr.shape[1:], arr.dtype, arr)
        if n == 1:
            _copy_into(dst, arr)
        else:
            g.backend.reduce_scatter(flat(arr), flat(dst), op)
        return out
    result = np.empty((arr.shape[0] // n,) + arr.shape[1:], arr.dtype)
    g.backend.reduce_scatter(flat(arr), flat(result), op)
    return restore(result)


def reduce_scatter(x: Any, op: ReduceOp | str = ReduceOp.SUM, *, group: Group | None = None, out: Any = None) -> Any:
    """sum_scatter generalised to every ReduceOp (into out= when given)."""
    return _reduce_scatter(x, _reduce_op(op), group, out, "reduce_scatter")


def broadcast(x: Any, root: int = 0, *, group: Group | None = None, out: Any = None) -> Any:
    """root's x on every rank (every rank passes an array of the same shape and dtype); into
    out= when given (out=x broadcasts in place)."""
    fast = _fast(group)
    if fast is not None:
        done = fast.broadcast(x, out, root)  # type: ignore[attr-defined]
        if done is not NotImplemented:
            return done
    g = default_group(group)
    _check_peer(g, root, "broadcast root")
    if out is not None:
        if _on_device(g, x):
            _no_device_out(g, "broadcast", out)
        arr = as_numpy(x)[0]
        dst = _checked_out(g, "broadcast", out, arr.shape, arr.dtype, arr)
        if g.rank() == root:
            _copy_into(dst, arr)
        if g.size() > 1:
            g.backend.broadcast(flat(dst), root)
        return out
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
    fast = _fast(group)
    if fast is not None and fast.barrier() is not NotImplemented:  # type: ignore[attr-defined]
        return
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
