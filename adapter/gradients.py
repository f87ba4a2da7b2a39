"""average_gradients: the mean of a tree of gradients over a group, in few large messages.

Thousands of small all_sums each pay the network latency; one all_sum of their
concatenation pays it once. The leaves are packed, per (library, device, dtype), into flat
buffers of about `all_reduce_size` bytes; each buffer is summed over the group with one
collective, in place, and the results are handed back as views into it (no unpacking copy)
unless the caller asked for the averages in another dtype. A Module's large gradients are
re-pointed at their part of the buffer (the same tensor objects, no copy back).

The 1/size scale is applied while packing, as torch DDP's default hook does: the packing
pass does the division for free, and a float16 sum cannot overflow where the average fits.
Packing uses the leaves' own library (torch.cat, numpy.concatenate) so that thousands of
small leaves cost a few bulk calls rather than a Python loop of small ones.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import sys
import threading
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from .arrays import numpy_dtype
from .backends.base import ReduceOp
from .backends.elements import BFLOAT16
from .gradient_packing import Bucket, stage_array, stage_torch, torch_numpy_dtype
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
    gradient are skipped) and which is returned: each .grad stays the same tensor object, and
    large contiguous ones come back sharing memory with the packed buffer instead of being
    copied into. Every rank passes the same structure.
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
    types = _array_types()

    if _is_torch_module(gradients):
        named = [(name, p.grad) for name, p in gradients.named_parameters() if p.grad is not None]
        leaves = [grad for _, grad in named]
        plan = _plan(leaves, types, all_reduce_size, wire, lambda i: named[i][0])
        _average(leaves, plan, g, in_place=True, convert=wire is not None)
        return gradients

    leaves: list[Any] = []
    rebuild = _flatten(gradients, types, leaves, ())
    plan = _plan(leaves, types, all_reduce_size, wire, lambda i: _leaf_paths(gradients, types)[i])
    return rebuild(iter(_average(leaves, plan, g, in_place=False, convert=wire is not None)))


# ---- the tree ----------------------------------------------------------------------------------

def _is_torch_module(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.nn.Module)


def _array_types() -> tuple[type, ...]:
    """The leaf types: numpy's, and torch's and cupy's when the program has imported them."""
    types: list[type] = [np.ndarray, np.generic]
    for module, name in (("torch", "Tensor"), ("cupy", "ndarray")):
        if module in sys.modules:
            types.append(getattr(sys.modules[module], name))
    return tuple(types)


def _none(leaves: Iterator) -> None:
    return None


def _flatten(tree: Any, types: tuple, leaves: list, path: tuple) -> Callable[[Iterator], Any]:
    """Collect the array leaves of tree (depth first, in container order) and return a function
    that rebuilds the tree from an iterator over replacement leaves. A container of arrays
    only, the usual case, costs one step however many arrays it holds."""
    if isinstance(tree, types):
        leaves.append(tree)
        return next
    if tree is None:
        return _none
    if isinstance(tree, dict):
        kind, keys = type(tree), list(tree)
        if _only_arrays(tree.values(), types):
            leaves.extend(tree.values())
            return lambda it: kind(zip(keys, itertools.islice(it, len(keys))))
        parts = _flatten_children(tree.values(), keys, types, leaves, path)
        return lambda it: kind(zip(keys, [p(it) for p in parts]))
    if isinstance(tree, (list, tuple)):
        kind, count = type(tree), len(tree)
        spread = isinstance(tree, tuple) and hasattr(tree, "_fields")  # a namedtuple takes fields
        if _only_arrays(tree, types):
            leaves.extend(tree)
            if spread:
                return lambda it: kind(*itertools.islice(it, count))
            return lambda it: kind(itertools.islice(it, count))
        parts = _flatten_children(tree, range(count), types, leaves, path)
        if spread:
            return lambda it: kind(*[p(it) for p in parts])
        return lambda it: kind([p(it) for p in parts])
    where = _path_text(path) or "the input"
    raise TypeError(f"average_gradients: {where} is a {type(tree).__name__}; expected arrays "
                    "(torch, numpy, cupy) in dicts, lists and tuples, or a torch.nn.Module")


def _only_arrays(values: Iterable, types: tuple) -> bool:
    """Whether every value is an array: checked once per distinct type, not once per value."""
    return all(issubclass(cls, types) for cls in set(map(type, values)))


def _flatten_children(children: Iterable, keys: Iterable, types: tuple, leaves: list, path: tuple) -> list[Callable]:
    parts = []
    for key, child in zip(keys, children):
        if isinstance(child, types):
            leaves.append(child)
            parts.append(next)
        else:
            parts.append(_flatten(child, types, leaves, path + (key,)))
    return parts


def _path_text(path: tuple) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")


def _leaf_paths(tree: Any, types: tuple, path: tuple = ()) -> list[str]:
    """The leaves' paths, in _flatten's order (computed only to name a leaf in an error)."""
    if isinstance(tree, types):
        return [_path_text(path) or "<root>"]
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return [p for key, child in items for p in _leaf_paths(child, types, path + (key,))]


def _plan(leaves: list, types: tuple, all_reduce_size: int, wire: np.dtype | None,
          path_of: Callable[[int], str]) -> list[Bucket]:
    """Buckets in a deterministic order (every rank computes the same plan from the same tree).
    Leaves share a bucket when they share library, device and wire dtype."""
    if not leaves:
        return []
    uniform = _uniform_torch_kind(leaves, wire, path_of)
    if uniform is not None:
        # The usual case, every leaf a torch tensor of one dtype on one device: a few
        # comprehensions instead of a Python loop that reads each leaf's attributes.
        return _fill_buckets([uniform], None, list(map(sys.modules["torch"].Tensor.numel, leaves)), all_reduce_size)
    kinds_of_leaves: list[tuple] = []
    sizes: list[int] = []
    kinds: dict[tuple, tuple] = {}  # (type, device, dtype) -> (lib, location, wire dtype), checked once
    for index, x in enumerate(leaves):
        cls = type(x)
        if isinstance(x, (np.ndarray, np.generic)):
            key, count = (np.ndarray, None, x.dtype), x.size
        elif cls.__module__.startswith("torch"):
            key, count = (cls, x.device, x.dtype), x.numel()
        else:
            key, count = (cls, x.device.id, x.dtype), x.size
        kind = kinds.get(key)
        if kind is None:
            kind = kinds[key] = _kind_of(key, wire, lambda: path_of(index))
        kinds_of_leaves.append(kind)
        sizes.append(count)
    return _fill_buckets(list(kinds.values()), kinds_of_leaves if len(kinds) > 1 else None, sizes, all_reduce_size)


def _uniform_torch_kind(leaves: list, wire: np.dtype | None, path_of: Callable[[int], str]) -> tuple | None:
    """(lib, location, wire dtype) shared by every leaf when all are torch tensors of one dtype
    on one device; None otherwise (the general loop then sorts them out)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    classes = set(map(type, leaves))
    if not all(issubclass(c, torch.Tensor) and c.__module__.startswith("torch") for c in classes):
        return None
    dtypes = {x.dtype for x in leaves}
    if len(dtypes) != 1:
        return None
    first = leaves[0]
    if first.is_cpu:
        if not all(x.is_cpu for x in leaves):
            return None
        device = first.device
    else:
        devices = {x.device for x in leaves}
        if len(devices) != 1:
            return None
        (device,) = devices
    return _kind_of((type(first), device, first.dtype), wire, lambda: path_of(0))


def _fill_buckets(kinds: list[tuple], kind_of_leaf: list[tuple] | None, sizes: list[int],
                  all_reduce_size: int) -> list[Bucket]:
    """Split the leaves into buckets: per kind, in leaf order, closing a bucket once it holds
    all_reduce_size bytes; a leaf that large alone gets its own; empty leaves get none.
    kind_of_leaf is None when every leaf is of kinds[0]."""
    if kind_of_leaf is None:
        kind = kinds[0]
        total = sum(sizes)
        if 0 < total * kind[2].itemsize < all_reduce_size:  # everything fits in one bucket
            if 0 in sizes:
                indices = [i for i, size in enumerate(sizes) if size]
                return [Bucket(*kind, indices, [sizes[i] for i in indices], total)]
            return [Bucket(*kind, list(range(len(sizes))), sizes, total)]
        kind_of_leaf = itertools.repeat(kind)  # type: ignore[assignment]
    buckets: list[Bucket] = []
    open_buckets: dict[tuple, Bucket] = {}
    for index, (kind, count) in enumerate(zip(kind_of_leaf, sizes)):
        if count == 0:
            continue
        nbytes = count * kind[2].itemsize
        if all_reduce_size <= 0 or nbytes >= all_reduce_size:
            buckets.append(Bucket(*kind, [index], [count], count))
            continue
        bucket = open_buckets.get(kind)
        if bucket is None:
            bucket = open_buckets[kind] = Bucket(*kind)
            buckets.append(bucket)
        bucket.indices.append(index)
        bucket.sizes.append(count)
        bucket.elements += count
        if bucket.elements * kind[2].itemsize >= all_reduce_size:
            del open_buckets[kind]
    return buckets


def _kind_of(key: tuple, wire: np.dtype | None, path: Callable[[], str]) -> tuple:
    cls, location, dtype = key
    if cls.__module__.startswith("torch"):
        lib, dtype = "torch", torch_numpy_dtype(dtype)
    elif cls.__module__.startswith("cupy"):
        lib, dtype = "cupy", np.dtype(dtype)
    else:
        lib = "numpy"
    if dtype not in AVERAGEABLE:
        raise TypeError(f"average_gradients: {path()} has dtype {dtype}; only floating-point arrays can be averaged")
    return lib, location, wire or dtype


# ---- averaging ---------------------------------------------------------------------------------

def _average(leaves: list, plan: list[Bucket], group: Group, in_place: bool, convert: bool) -> list[Any]:
    """The averaged leaves, in order. convert: a communication type was asked for, so a
    bucket's dtype may differ from its leaves' (otherwise every leaf of a bucket has it)."""
    scale = 1.0 / group.size()
    # A backend that reads GPU memory itself (NCCL) gets device buckets as they are.
    direct = getattr(group.backend, "takes_device_buffers", False)
    # With several buckets, host collectives run on a helper thread, in order, so that the
    # next bucket is packed (and the previous one unpacked) while one is on the wire.
    overlap = len(plan) > 1 and not direct
    whole = len(plan) == 1 and len(plan[0].indices) == len(leaves)  # one bucket holds every leaf
    staged = []
    for bucket in plan:
        members = leaves if whole else [leaves[i] for i in bucket.indices]
        stage = stage_torch if bucket.lib == "torch" else stage_array
        step = stage(members, bucket, scale, in_place, direct, convert)
        if overlap:
            done = _communication_thread().submit(group.backend.all_reduce, step.wire, step.wire, ReduceOp.SUM)
        else:
            group.backend.all_reduce(step.wire, step.wire, ReduceOp.SUM)
            done = None
        staged.append((bucket, step, done))
    if whole:
        return staged[0][1].finish()
    results: list[Any] = list(leaves)  # empty leaves send nothing and come back as they are
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


