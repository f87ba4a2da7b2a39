"""average_gradients: the mean of a tree of gradients over a group, in few large messages.

Thousands of small all_sums each pay the network latency; one all_sum of their
concatenation pays it once. The leaves are packed, per (location, dtype), into flat
buffers of about `all_reduce_size` bytes, each buffer is summed over the group with one
collective, and the results are handed back as views into those buffers (no unpacking
copy) where the caller's type allows.

The 1/size scale is applied while packing (as torch DDP's default hook does), so the
packing pass does the division for free and the sum cannot overflow a float16 range that
the average fits in.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .arrays import as_numpy, numpy_dtype, numpy_to_torch
from .backends.base import ReduceOp
from .backends.elements import BFLOAT16
from .group import Group, default_group

DEFAULT_ALL_REDUCE_SIZE = 32 * 1024**2

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
    buffer reaches this size. A leaf at least this large travels alone, without a packing
    copy. <= 0 sends one message per leaf.
    communication_type: a floating dtype (numpy, torch or a name such as "bfloat16") the
    values are cast to for the transfer and back from, to halve the bytes on the wire.
    In a group of size 1 the input is returned untouched.
    """
    g = default_group(group)
    size = g.size()
    if size == 1:
        return gradients
    wire = None if communication_type is None else numpy_dtype(communication_type)
    if wire is not None and wire not in AVERAGEABLE:
        raise TypeError(f"communication_type must be a floating dtype, not {wire}")

    if _is_torch_module(gradients):
        named = [(name, p.grad) for name, p in gradients.named_parameters() if p.grad is not None]
        leaves = [_Leaf.of(grad, name, wire) for name, grad in named]
        _average(leaves, g, all_reduce_size, in_place=True)
        return gradients

    found: list[tuple[str, Any]] = []
    rebuild = _flatten(gradients, "", found)
    leaves = [_Leaf.of(x, path, wire) for path, x in found]
    results = _average(leaves, g, all_reduce_size, in_place=False)
    return rebuild(iter(results))


# ---- the tree --------------------------------------------------------------------------

def _is_torch_module(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.nn.Module)


def _is_array(x: Any) -> bool:
    module = type(x).__module__
    if module.startswith("torch"):
        torch = sys.modules.get("torch")
        return torch is not None and isinstance(x, torch.Tensor)
    if module.startswith("cupy"):
        return hasattr(x, "__cuda_array_interface__")
    return isinstance(x, (np.ndarray, np.generic))


def _flatten(tree: Any, path: str, found: list[tuple[str, Any]]) -> Callable:
    """Collect the array leaves of tree into found (depth first, in container order) and
    return a function that rebuilds the tree from an iterator over replacement leaves."""
    if _is_array(tree):
        found.append((path or "<root>", tree))
        return lambda leaves: next(leaves)
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


# ---- leaves and buckets ------------------------------------------------------------------

@dataclass
class _Leaf:
    path: str
    source: Any
    kind: str  # "numpy", "scalar", "torch", "cupy"
    location: tuple  # ("host",) or the device the leaf lives on
    dtype: np.dtype
    wire: np.dtype
    shape: tuple
    size: int

    @classmethod
    def of(cls, x: Any, path: str, wire: np.dtype | None) -> "_Leaf":
        module = type(x).__module__
        if module.startswith("torch"):
            kind = "torch"
            location = ("host",) if x.device.type == "cpu" else ("torch", str(x.device))
            dtype = numpy_dtype(x.dtype)
        elif module.startswith("cupy"):
            kind, location, dtype = "cupy", ("cupy", x.device.id), np.dtype(x.dtype)
        else:
            kind = "scalar" if isinstance(x, np.generic) else "numpy"
            location, dtype = ("host",), np.dtype(x.dtype)
        if dtype not in AVERAGEABLE:
            raise TypeError(f"average_gradients: {path} has dtype {dtype}; only floating-point arrays can be averaged")
        shape = tuple(x.shape)
        return cls(path, x, kind, location, dtype, wire or dtype, shape, int(np.prod(shape, dtype=np.int64)))

    @property
    def wire_bytes(self) -> int:
        return self.size * self.wire.itemsize


@dataclass
class _Bucket:
    location: tuple
    wire: np.dtype
    leaves: list[tuple[int, _Leaf]] = field(default_factory=list)  # (index in the tree, leaf)
    nbytes: int = 0


def _plan(leaves: list[_Leaf], all_reduce_size: int) -> list[_Bucket]:
    """Buckets in a deterministic order (every rank computes the same plan from the same tree)."""
    buckets: list[_Bucket] = []
    open_buckets: dict[tuple, _Bucket] = {}
    for index, leaf in enumerate(leaves):
        if leaf.size == 0:
            continue
        key = (leaf.location, leaf.wire)
        if all_reduce_size <= 0 or leaf.wire_bytes >= all_reduce_size:
            buckets.append(_Bucket(leaf.location, leaf.wire, [(index, leaf)], leaf.wire_bytes))
            continue
        bucket = open_buckets.get(key)
        if bucket is None:
            bucket = open_buckets[key] = _Bucket(leaf.location, leaf.wire)
            buckets.append(bucket)
        bucket.leaves.append((index, leaf))
        bucket.nbytes += leaf.wire_bytes
        if bucket.nbytes >= all_reduce_size:
            del open_buckets[key]
    return buckets


# ---- averaging ---------------------------------------------------------------------------

def _average(leaves: list[_Leaf], group: Group, all_reduce_size: int, in_place: bool) -> list[Any]:
    results: list[Any] = [None] * len(leaves)
    for index, leaf in enumerate(leaves):
        if leaf.size == 0:
            results[index] = leaf.source
    scale = 1.0 / group.size()
    for bucket in _plan(leaves, all_reduce_size):
        if bucket.location == ("host",):
            _average_on_host(bucket, group, scale, in_place, results)
        else:
            _average_on_device(bucket, group, scale, in_place, results)
    return results


def _writable_host_view(leaf: _Leaf) -> np.ndarray | None:
    """The leaf's own memory as a 1-D numpy array, when it has one (CPU and contiguous)."""
    if leaf.kind == "numpy" and leaf.source.flags.c_contiguous and leaf.source.flags.writeable:
        return leaf.source.reshape(-1)
    if leaf.kind == "torch" and leaf.source.is_contiguous():
        return as_numpy(leaf.source)[0].reshape(-1)
    return None


def _average_on_host(bucket: _Bucket, group: Group, scale: float, in_place: bool, results: list) -> None:
    if in_place and len(bucket.leaves) == 1:
        index, leaf = bucket.leaves[0]
        own = _writable_host_view(leaf)
        if own is not None and leaf.wire == leaf.dtype:
            # A large gradient averaged where it lies: no packing copy, no unpacking copy.
            np.multiply(own, scale, out=own)
            group.backend.all_reduce(own, own, ReduceOp.SUM)
            results[index] = leaf.source
            return
    buf = np.empty(bucket.nbytes // bucket.wire.itemsize, bucket.wire)
    offsets = []
    offset = 0
    for _, leaf in bucket.leaves:
        values = as_numpy(leaf.source)[0].reshape(-1)
        np.multiply(values, scale, out=buf[offset:offset + leaf.size], casting="unsafe")
        offsets.append(offset)
        offset += leaf.size
    group.backend.all_reduce(buf, buf, ReduceOp.SUM)
    for (index, leaf), start in zip(bucket.leaves, offsets):
        part = buf[start:start + leaf.size]
        results[index] = _write_back(leaf, part) if in_place else _host_result(leaf, part)


def _host_result(leaf: _Leaf, part: np.ndarray) -> Any:
    """A new array of the leaf's kind, dtype and shape: a view of part when the types agree."""
    values = part if leaf.wire == leaf.dtype else part.astype(leaf.dtype)
    values = values.reshape(leaf.shape)
    if leaf.kind == "torch":
        return numpy_to_torch(values)
    if leaf.kind == "scalar":
        return values[()]
    return values


def _write_back(leaf: _Leaf, part: np.ndarray) -> Any:
    """Store the averaged values into the leaf's own memory (the Module case)."""
    own = _writable_host_view(leaf)
    if own is not None:
        np.copyto(own, part, casting="unsafe")
    else:
        leaf.source.copy_(numpy_to_torch(part.astype(leaf.dtype)).reshape(leaf.shape))
    return leaf.source


def _average_on_device(bucket: _Bucket, group: Group, scale: float, in_place: bool, results: list) -> None:
    """GPU leaves: pack on the device, one copy to the host and one back per bucket (the
    backends reduce in host memory), then split on the device."""
    if bucket.location[0] == "torch":
        import torch

        lib_cat, device = torch.cat, bucket.leaves[0][1].source.device
        wire = numpy_to_torch(np.empty(0, bucket.wire)).dtype
        packed = lib_cat([(leaf.source.detach().reshape(-1) * scale).to(wire) for _, leaf in bucket.leaves])
        host, _ = as_numpy(packed)
        group.backend.all_reduce(host, host, ReduceOp.SUM)
        summed = numpy_to_torch(host, device)
        cast = lambda part, leaf: part.to(leaf.source.dtype)  # noqa: E731
    else:
        import cupy

        packed = cupy.concatenate([(leaf.source.reshape(-1) * scale).astype(bucket.wire) for _, leaf in bucket.leaves])
        host = cupy.asnumpy(packed)
        group.backend.all_reduce(host, host, ReduceOp.SUM)
        with cupy.cuda.Device(bucket.location[1]):
            summed = cupy.asarray(host)
        cast = lambda part, leaf: part.astype(leaf.dtype)  # noqa: E731
    offset = 0
    for index, leaf in bucket.leaves:
        part = cast(summed[offset:offset + leaf.size], leaf).reshape(leaf.shape)
        offset += leaf.size
        if in_place:
            leaf.source.copy_(part)
            part = leaf.source
        results[index] = part
