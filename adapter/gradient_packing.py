"""average_gradients' buckets: the plan's record of one bucket, packing its leaves into one flat
buffer (scaled by 1/size on the way), and handing the averaged leaves back from the summed
buffer, for torch, numpy and cupy leaves (host buffers reused from call to call)."""
from __future__ import annotations

import contextlib
import itertools
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import gpu
from .arrays import as_numpy, numpy_dtype, numpy_to_torch

# A leaf this large is scaled straight into the buffer (one pass); smaller ones are
# concatenated in one call and scaled together (two passes over little memory, few calls).
FUSED_SCALE_ELEMENTS = 1 << 16

# ---- buckets -----------------------------------------------------------------------------------

_TORCH_DTYPES: dict[Any, np.dtype] = {}


def torch_numpy_dtype(dtype: Any) -> np.dtype:
    found = _TORCH_DTYPES.get(dtype)
    if found is None:
        found = _TORCH_DTYPES[dtype] = numpy_dtype(dtype)
    return found


@dataclass(slots=True)
class Bucket:
    lib: str  # "torch", "numpy" or "cupy": the library that packs and unpacks it
    location: Any  # a torch device, a cupy device id, or None (numpy)
    wire: np.dtype
    indices: list[int] = field(default_factory=list)  # positions of its leaves among all leaves
    sizes: list[int] = field(default_factory=list)
    elements: int = 0

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


def stage_torch(members: list, bucket: Bucket, scale: float, in_place: bool, direct: bool,
                 convert: bool) -> _Staged:
    import torch

    device = bucket.location
    first = members[0]
    if (in_place and len(members) == 1 and device.type == "cpu" and first.is_contiguous()
            and torch_numpy_dtype(first.dtype) == bucket.wire):
        # A large gradient averaged where it lies: no packing copy, no unpacking copy.
        with torch.no_grad():
            first.mul_(scale)
        return _Staged(as_numpy(first)[0].reshape(-1), lambda: [first])

    if device.type == "cpu":
        host = _POOL.take(bucket.wire, bucket.elements)
        buf = numpy_to_torch(host)
    else:
        buf = torch.empty(bucket.elements, dtype=numpy_to_torch(np.empty(0, bucket.wire)).dtype, device=device)
    # Leaves that are not 1-D are flattened to pack them and viewed in their shape again after
    # (ravel and view_as: the cheapest calls for it); a bucket of 1-D leaves skips both.
    dims = list(map(torch.Tensor.dim, members))
    flat_already = dims.count(1) == len(dims)
    with torch.no_grad():  # gradients may require grad themselves (create_graph=True)
        flat = members if flat_already else [x if d == 1 else x.ravel() for x, d in zip(members, dims)]
        _pack(flat, bucket.sizes, buf, scale,
              concat=lambda parts, out: torch.cat(parts, out=out),
              scaled=lambda x, out: torch.mul(x, scale, out=out))
    # On the CPU the buffer itself; a GPU buffer is staged (one copy each way) unless direct.
    if device.type == "cpu":
        wire = host
    else:
        wire = gpu.device_buffer(buf) if direct else as_numpy(buf)[0]

    @torch.no_grad()
    def finish() -> list:
        summed = buf if device.type == "cpu" or direct else numpy_to_torch(wire, device)
        parts = summed.split_with_sizes(bucket.sizes)
        if not flat_already:
            parts = [part if d == 1 else part.view_as(x) for part, x, d in zip(parts, members, dims)]
        if in_place:
            _adopt(members, parts)
            return list(members)
        if convert:
            return [part if part.dtype == x.dtype else part.to(x.dtype) for part, x in zip(parts, members)]
        return list(parts)

    return _Staged(wire, finish)


# A gradient this large is pointed at its part of the bucket rather than copied into: one
# Tensor.set_ call costs about as much as copying a few thousand elements.
ADOPT_ELEMENTS = 1 << 12


def _adopt(members: list, parts: list) -> None:
    """Give each gradient its averaged values. A large contiguous one is re-pointed at its part
    of the summed bucket with Tensor.set_ (the same object, so references to p.grad stay valid,
    and no copy back: as DDP's gradient_as_bucket_view); the bucket's host buffer then stays
    busy in the pool until the gradient lets go of it. The others are copied into, in one call
    that also casts back to each gradient's dtype: small ones, non-contiguous layouts (kept as
    the user made them), another dtype than the bucket's, and gradients in an autograd graph."""
    import torch

    copy_to, copy_from = [], []
    for x, part in zip(members, parts):
        if (x.numel() >= ADOPT_ELEMENTS and x.dtype == part.dtype and not x.requires_grad
                and x.is_contiguous() and x.layout == torch.strided):
            x.set_(part)
        else:
            copy_to.append(x)
            copy_from.append(part)
    if copy_to:
        torch._foreach_copy_(copy_to, copy_from)


def stage_array(members: list, bucket: Bucket, scale: float, in_place: bool, direct: bool,
                 convert: bool) -> _Staged:
    """numpy leaves, and cupy leaves packed on their GPU and staged through host memory."""
    if bucket.lib == "cupy":
        import cupy as xp

        on_device: Any = xp.cuda.Device(bucket.location)
    else:
        xp, on_device = np, contextlib.nullcontext()
    with on_device:
        buf = _POOL.take(bucket.wire, bucket.elements) if xp is np else xp.empty(bucket.elements, bucket.wire)
        _pack([xp.asarray(x).reshape(-1) for x in members], bucket.sizes, buf, scale,
              concat=lambda parts, out: xp.concatenate(parts, out=out, casting="unsafe"),
              scaled=lambda x, out: xp.multiply(x, scale, out=out, casting="unsafe"))
    if xp is np:
        wire = buf
    else:
        wire = gpu.device_buffer(buf) if direct else xp.asnumpy(buf)

    def finish() -> list:
        with on_device:
            summed = buf if xp is np or direct else xp.asarray(wire)
        out, offset = [], 0
        for x, size in zip(members, bucket.sizes):
            part = summed[offset:offset + size].reshape(x.shape)
            offset += size
            if part.dtype != x.dtype:
                part = part.astype(x.dtype)
            out.append(part[()] if isinstance(x, np.generic) else part)
        return out

    return _Staged(wire, finish)


def _pack(flat: list, sizes: list[int], buf: Any, scale: float, concat: Callable, scaled: Callable) -> None:
    """buf = concatenation of the flattened members times scale, cast to buf's dtype: large
    members in one fused pass each, runs of small ones with one concatenate and one scale
    per run (all of them, usually, in one run)."""
    if max(sizes) < FUSED_SCALE_ELEMENTS:
        concat(flat, buf)
        buf *= scale
        return
    offsets = list(itertools.accumulate(sizes, initial=0))
    run_start = 0  # the first member of the current run of small ones

    def flush(end: int) -> None:
        if run_start < end:
            window = buf[offsets[run_start]:offsets[end]]
            concat(flat[run_start:end], window)
            window *= scale

    for i in [i for i, size in enumerate(sizes) if size >= FUSED_SCALE_ELEMENTS]:
        flush(i)
        scaled(flat[i], buf[offsets[i]:offsets[i + 1]])
        run_start = i + 1
    flush(len(sizes))
