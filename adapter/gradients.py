"""average_gradients: the mean of a tree of gradients over a group, in few large messages.

Thousands of small all_sums each pay the network latency; one all_sum of their
concatenation pays it once. The leaves are packed, per (library, device, dtype), into flat
buffers of about `all_reduce_size` bytes; each buffer is summed over the group with one
collective, in place, and the results are handed back as views into it (no unpacking copy)
unless the caller asked for the averages in place (a Module's .grad) or in another dtype.

The 1/size scale is applied while packing, as torch DDP's default hook does: the packing
pass does the division for free, and a float16 sum cannot overflow where the average fits.
Packing uses the leaves' own library (torch.cat, numpy.concatenate) so that thousands of
small leaves cost a few bulk calls rather than a Python loop of small ones.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import math
import threading
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import gpu
from .arrays import as_numpy, numpy_dtype, numpy_to_torch
from .backends.base import ReduceOp
from .backends.elements import BFLOAT16
from .group import Group, default_group

DEFAULT_ALL_REDUCE_SIZE = 32 * 1024**2
# A leaf this large is scaled straight into the buffer (one pass); smaller ones are
# concatenated in one call and scaled together (two passes over little memory, few calls).
FUSED_SCALE_ELEMENTS = 1 << 16

# Averaging is only meaningful for floating-point values.
AVERAGEABLE = frozenset(
    np.dtype(d) for d in (np.float16, BFLOAT16, np.float32, np.float64, np.complex64, np.complex128)
)


def average_gradients(
    gradients: Any,
    group: Group | None = None,
    all_reduce_size: int = DEFAULT_ALL_REDUCE_SIZE,
    communication_type: Any = None,
) -> Any:
    """Average gradients over every rank of the group.

    gradients: torch tensors, numpy arrays or cupy arrays in nested dicts, lists and tuples
    (the same structure comes back, with new arrays; the input is not modified), or a
    torch.nn.Module whose parameters' .grad are averaged in place (parameters without a
    gradient are skipped) and which is returned. Every rank passes the same structure.
    all_reduce_size: bytes per message; leaves are packed, per dtype and device, until a
    buffer reaches this size. A leaf at least this large travels alone. <= 0 sends one
    message per leaf.
    communication_type: a floating dtype (numpy, torch or a name such as "bfloat16") the
    values are cast to for the transfer and back from, to cut the bytes on the wire.
    In a group of size 1 the input is returned untouched.
    """
    g = default_group(group)
    if g.size() == 1:
        return gradients
    wire = None if communication_type is None else numpy_dtype(communication_type)
    if wire is not None and wire not in AVERAGEABLE:
        raise TypeError(f"communication_type must be a floating dtype, not {wire}")

    if _is_torch_module(gradients):
        leaves = [_Leaf.of(p.grad, name, wire) for name, p in gradients.named_parameters() if p.grad is not None]
        _average(leaves, g, all_reduce_size, in_place=True)
        return gradients

    found: list[tuple[str, Any]] = []
    rebuild = _flatten(gradients, "", found)
    leaves = [_Leaf.of(x, path, wire) for path, x in found]
    return rebuild(iter(_average(leaves, g, all_reduce_size, in_place=False)))


# ---- the tree ----------------------------------------------------------------------------------

def _is_torch_module(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.nn.Module)


def _is_array(x: Any) -> bool:
    if isinstance(x, (np.ndarray, np.generic)):
        return True
    module = type(x).__module__
    if module.startswith("torch"):
        return isinstance(x, sys.modules["torch"].Tensor)
    return module.startswith("cupy") and hasattr(x, "__cuda_array_interface__")


def _flatten(tree: Any, path: str, found: list[tuple[str, Any]]) -> Callable:
    """Collect the array leaves of tree into found (depth first, in container order) and
    return a function that rebuilds the tree from an iterator over replacement leaves."""
    if _is_array(tree):
        found.append((path or "<root>", tree))
        return next
    if tree is None:
        return lambda leaves: None
    if isinstance(tree, dict):
        keys = list(tree)
        parts = [_flatten(tree[k], f"{path}.{k}" if path else str(k), found) for k in keys]
        kind = type(tree)
        return lambda leaves: kind(zip(keys, [p(leaves) for p in parts]))
    if isinstance(tree, (list, tuple)):
        parts = [_flatten(v, f"{path}[{i}]", found) for i, v in enumerate(tree)]
        kind = type(tree)
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
            return lambda leaves: kind(*[p(leaves) for p in parts])
        return lambda leaves: kind([p(leaves) for p in parts])
    raise TypeError(
        f"average_gradients: {path or 'the input'} is a {type(tree).__name__}; expected arrays "
        "(torch, numpy, cupy) in dicts, lists and tuples, or a torch.nn.Module"
    )


# ---- leaves and buckets ------------------------------------------------------------------------

_TORCH_DTYPES: dict[Any, np.dtype] = {}


def _torch_numpy_dtype(dtype: Any) -> np.dtype:
    found = _TORCH_DTYPES.get(dtype)
    if found is None:
        found = _TORCH_DTYPES[dtype] = numpy_dtype(dtype)
    return found


@dataclass(slots=True)
class _Leaf:
    path: str
    source: Any
    lib: str  # "torch", "numpy" or "cupy": the library that packs and unpacks it
    location: tuple  # leaves sharing (location, wire dtype) share buffers
    dtype: np.dtype
    wire: np.dtype
    shape: tuple
    size: int

    @classmethod
    def of(cls, x: Any, path: str, wire: np.dtype | None) -> "_Leaf":
        if isinstance(x, (np.ndarray, np.generic)):
            lib, location, dtype = "numpy", ("numpy",), x.dtype
        elif type(x).__module__.startswith("torch"):
            lib, location, dtype = "torch", ("torch", x.device), _torch_numpy_dtype(x.dtype)
        else:
            lib, location, dtype = "cupy", ("cupy", x.device.id), np.dtype(x.dtype)
        if dtype not in AVERAGEABLE:
            raise TypeError(f"average_gradients: {path} has dtype {dtype}; only floating-point arrays can be averaged")
        shape = tuple(x.shape)
        return cls(path, x, lib, location, dtype, wire or dtype, shape, math.prod(shape))


@dataclass(slots=True)
class _Bucket:
    location: tuple
    wire: np.dtype
    indices: list[int] = field(default_factory=list)  # positions of its leaves in the tree
    elements: int = 0


def _plan(leaves: list[_Leaf], all_reduce_size: int) -> list[_Bucket]:
    """Buckets in a deterministic order (every rank computes the same plan from the same tree)."""
    buckets: list[_Bucket] = []
    open_buckets: dict[tuple, _Bucket] = {}
    for index, leaf in enumerate(leaves):
        if leaf.size == 0:
            continue
        nbytes = leaf.size * leaf.wire.itemsize
        if all_reduce_size <= 0 or nbytes >= all_reduce_size:
            buckets.append(_Bucket(leaf.location, leaf.wire, [index], leaf.size))
            continue
        key = (leaf.location, leaf.wire)
        bucket = open_buckets.get(key)
        if bucket is None:
            bucket = open_buckets[key] = _Bucket(leaf.location, leaf.wire)
            buckets.append(bucket)
        bucket.indices.append(index)
        bucket.elements += leaf.size
        if bucket.elements * leaf.wire.itemsize >= all_reduce_size:
            del open_buckets[key]
    return buckets


# ---- averaging ---------------------------------------------------------------------------------

def _average(leaves: list[_Leaf], group: Group, all_reduce_size: int, in_place: bool) -> list[Any]:
    # Empty leaves send nothing and come back as they are.
    results: list[Any] = [leaf.source if leaf.size == 0 else None for leaf in leaves]
    scale = 1.0 / group.size()
    plan = _plan(leaves, all_reduce_size)
    # A backend that reads GPU memory itself (NCCL) gets device buckets as they are.
    direct = getattr(group.backend, "takes_device_buffers", False)
    # With several buckets, host collectives run on a helper thread, in order, so that the
    # next bucket is packed (and the previous one unpacked) while one is on the wire.
    overlap = len(plan) > 1 and not direct
    staged = []
    for bucket in plan:
        members = [leaves[i] for i in bucket.indices]
        stage = _stage_torch if members[0].lib == "torch" else _stage_array
        step = stage(members, bucket, scale, in_place, direct)
        if overlap:
            done = _communication_thread().submit(group.backend.all_reduce, step.wire, step.wire, ReduceOp.SUM)
        else:
            group.backend.all_reduce(step.wire, step.wire, ReduceOp.SUM)
            done = None
        staged.append((bucket, step, done))
    error = None
    for bucket, step, done in staged:
        try:
            if done is not None:
                done.result()
        except BaseException as exc:  # wait for every collective before raising the first error
            error = error or exc
            continue
        if error is None:
            for index, value in zip(bucket.indices, step.finish()):
                results[index] = value
    if error is not None:
        raise error
    return results


_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _communication_thread() -> concurrent.futures.ThreadPoolExecutor:
    """One worker thread, so collectives run strictly in submission order on every rank."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jacklring-average")
        return _executor


class _HostPool:
    """Host buffers reused from call to call. Fresh memory costs a page fault per 4 KiB on
    first touch, which for gradient-sized buffers costs as much as packing itself. A buffer is
    reused once nothing outside the pool refers to it: every view handed out (numpy views and
    torch tensors made from it hold a reference) has been dropped."""

    PER_SIZE = 2  # buffers kept per (dtype, size): enough for results still held for one step
    SIZES = 64  # distinct (dtype, size) kept; the oldest go first

    def __init__(self) -> None:
        self._buffers: dict[tuple, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, dtype: np.dtype, count: int) -> np.ndarray:
        key = (dtype, count)
        with self._lock:
            kept = self._buffers.setdefault(key, [])
            for buf in kept:
                if sys.getrefcount(buf) <= 3:  # the list, this loop's name and the call's argument
                    return buf
            buf = np.empty(count, dtype)
            if len(kept) < self.PER_SIZE:
                kept.append(buf)
            while len(self._buffers) > self.SIZES:
                del self._buffers[next(iter(self._buffers))]
            return buf


_POOL = _HostPool()


@dataclass(slots=True)
class _Staged:
    wire: Any  # what the backend sums in place: the packed bucket in host memory, or a DeviceBuffer
    finish: Callable[[], list]  # the bucket's averaged leaves, once wire holds the sum


def _stage_torch(members: list[_Leaf], bucket: _Bucket, scale: float, in_place: bool, direct: bool) -> _Staged:
    import torch

    device = bucket.location[1]
    first = members[0].source
    if in_place and len(members) == 1 and device.type == "cpu" and first.is_contiguous() and members[0].wire == members[0].dtype:
        # A large gradient averaged where it lies: no packing copy, no unpacking copy.
        with torch.no_grad():
            first.mul_(scale)
        return _Staged(as_numpy(first)[0].reshape(-1), lambda: [first])

    if device.type == "cpu":
        buf = numpy_to_torch(_POOL.take(bucket.wire, bucket.elements))
    else:
        wire_dtype = numpy_to_torch(np.empty(0, bucket.wire)).dtype
        buf = torch.empty(bucket.elements, dtype=wire_dtype, device=device)
    with torch.no_grad():  # gradients may require grad themselves (create_graph=True)
        _pack(members, buf, scale,
              concat=lambda parts, out: torch.cat(parts, out=out),
              scaled=lambda flat, out: torch.mul(flat, scale, out=out),
              flatten=lambda x: x if x.dim() == 1 else x.reshape(-1))
    on_host = device.type == "cpu" or not direct
    # On the CPU the buffer itself; a GPU buffer is staged (one copy each way) unless direct.
    wire = as_numpy(buf)[0] if on_host else gpu.device_buffer(buf)

    @torch.no_grad()
    def finish() -> list:
        summed = buf if device.type == "cpu" or direct else numpy_to_torch(wire, device)
        out = []
        for leaf, part in zip(members, summed.split_with_sizes([leaf.size for leaf in members])):
            if len(leaf.shape) != 1:
                part = part.view(leaf.shape)
            if leaf.wire != leaf.dtype:
                part = part.to(leaf.source.dtype)
            if in_place:
                leaf.source.copy_(part)
                part = leaf.source
            out.append(part)
        return out

    return _Staged(wire, finish)


def _stage_array(members: list[_Leaf], bucket: _Bucket, scale: float, in_place: bool, direct: bool) -> _Staged:
    """numpy leaves, and cupy leaves packed on their GPU and staged through host memory."""
    if members[0].lib == "cupy":
        import cupy as xp

        on_device: Any = xp.cuda.Device(bucket.location[1])
    else:
        xp, on_device = np, contextlib.nullcontext()
    with on_device:
        buf = _POOL.take(bucket.wire, bucket.elements) if xp is np else xp.empty(bucket.elements, bucket.wire)
        _pack(members, buf, scale,
              concat=lambda parts, out: xp.concatenate(parts, out=out, casting="unsafe"),
              scaled=lambda flat, out: xp.multiply(flat, scale, out=out, casting="unsafe"),
              flatten=lambda x: xp.asarray(x).reshape(-1))
    if xp is np:
        wire = buf
    else:
        wire = gpu.device_buffer(buf) if direct else xp.asnumpy(buf)

    def finish() -> list:
        with on_device:
            summed = buf if xp is np or direct else xp.asarray(wire)
        out, offset = [], 0
        for leaf in members:
            part = summed[offset:offset + leaf.size].reshape(leaf.shape)
            offset += leaf.size
            if leaf.wire != leaf.dtype:
                part = part.astype(leaf.dtype)
            out.append(part[()] if isinstance(leaf.source, np.generic) else part)
        return out

    return _Staged(wire, finish)


def _pack(members: list[_Leaf], buf: Any, scale: float, concat: Callable, scaled: Callable, flatten: Callable) -> None:
    """buf = concatenation of the members times scale, cast to buf's dtype: large members in
    one fused pass each, runs of small ones with one concatenate and one scale per run."""
    run: list[Any] = []
    run_start = offset = 0

    def flush(end: int) -> None:
        if run:
            window = buf[run_start:end]
            concat(run, window)
            window *= scale
            run.clear()

    for leaf in members:
        flat = flatten(leaf.source)
        if leaf.size >= FUSED_SCALE_ELEMENTS:
            flush(offset)
            scaled(flat, buf[offset:offset + leaf.size])
            run_start = offset + leaf.size
        else:
            run.append(flat)
        offset += leaf.size
    flush(offset)
