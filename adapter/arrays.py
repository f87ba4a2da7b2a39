"""numpy / torch / cupy buffers <-> 1-D numpy views, without copies where the input allows.

The host backends only see numpy arrays. A contiguous numpy array or CPU tensor is viewed
in place; a non-contiguous one is made contiguous once; cupy arrays and CUDA tensors are
staged through pinned host memory (adapter.gpu). The NCCL backend takes device buffers
directly instead (see adapter.ops).
"""
from __future__ import annotations

import ctypes
import sys
from typing import Any, Callable

import numpy as np

from . import gpu
from .backends.elements import BFLOAT16, DTYPE_CODES

Restore = Callable[[np.ndarray], Any]


def _torch_to_numpy(t: Any) -> np.ndarray:
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # A lazily conjugated or negated view (x.conj(), some autograd results) has no numpy view:
    # materialise it once, like a non-contiguous tensor.
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        signed = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}[t.dtype]
        unsigned = {torch.uint16: np.uint16, torch.uint32: np.uint32, torch.uint64: np.uint64}[t.dtype]
        return t.view(signed).numpy().view(unsigned)
    return t.numpy()


def out_view(x: Any) -> np.ndarray | None:
    """The numpy view sharing x's memory, for an out= buffer: x itself for a numpy array, a
    view of a CPU torch tensor; None for anything else (GPU buffers, lists). Never a copy, so
    what the caller checks on it (shape, dtype, contiguity) is true of x."""
    if type(x) is np.ndarray:
        return x
    if gpu.library_of(x) != "torch" or x.device.type != "cpu" or x.is_conj() or x.is_neg():
        return None
    import torch

    t = x.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        signed = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}[t.dtype]
        return t.view(signed).numpy().view(np.dtype(str(t.dtype).replace("torch.", "")))
    return t.numpy()


_PLAIN_TENSOR_DTYPES: frozenset = frozenset()  # torch dtypes whose tensors have a numpy view as they are
_TENSOR_TYPE: type | None = None
_FROM_NUMPY: Callable[[np.ndarray], Any] | None = None


def plain_cpu_tensor_view(x: Any) -> np.ndarray | None:
    """The numpy view of a plain torch.Tensor on the CPU, contiguous, not needing grad, of a
    dtype numpy shares (float32, int64, ...), in a few attribute reads; None for anything else,
    which then takes as_numpy. Never imports torch: without it in sys.modules x is no tensor."""
    global _TENSOR_TYPE, _PLAIN_TENSOR_DTYPES, _FROM_NUMPY
    if _TENSOR_TYPE is None:
        torch = sys.modules.get("torch")
        if torch is None or not hasattr(torch, "Tensor"):
            return None
        _PLAIN_TENSOR_DTYPES = frozenset(
            getattr(torch, name) for name in ("bool", "int8", "int16", "int32", "int64", "uint8", "float16",
                                              "float32", "float64", "complex64", "complex128"))
        _FROM_NUMPY = torch.from_numpy
        _TENSOR_TYPE = torch.Tensor
    if (type(x) is not _TENSOR_TYPE or not x.is_cpu or x.requires_grad or x.dtype not in _PLAIN_TENSOR_DTYPES
            or not x.is_contiguous() or x.is_conj() or x.is_neg()):
        return None
    return x.numpy()


# Views for call_view, by the address of their first byte: (element count, torch dtype, view);
# and the addresses seen once.
_CALL_VIEWS: dict[int, tuple] = {}
_CALL_VIEWS_SEEN: set[int] = set()
_CALL_VIEWS_KEPT = 64  # a workload cycling through more buffers than this starts over


def call_view(x: Any) -> np.ndarray | None:
    """The 1-D numpy view of a tensor plain_cpu_tensor_view accepts, for a call that holds the
    tensor until it returns; None for anything else. The view does not keep the tensor's memory
    alive, so it must not outlive the call (never store it, never hand it to another thread that
    may run after the call returns).

    x.numpy() costs more than the rest of a small collective's checks together, and the same
    buffers come back call after call (a layer's activations, a gradient bucket). So views are
    kept by address, element count and dtype, and one is handed out again only for a live tensor
    of that dtype covering exactly those bytes: memory freed and reused meanwhile is then the
    caller's tensor's memory, never stale. Keeping the views does not keep any memory alive."""
    if type(x) is not _TENSOR_TYPE:
        if _TENSOR_TYPE is not None:
            return None
        plain_cpu_tensor_view(None)  # looks torch up, once
        if type(x) is not _TENSOR_TYPE:
            return None
    if (not x.is_cpu or x.requires_grad or x.dtype not in _PLAIN_TENSOR_DTYPES or not x.is_contiguous()
            or x.is_conj() or x.is_neg()):
        return None
    address, count, dtype = x.data_ptr(), x.numel(), x.dtype
    kept = _CALL_VIEWS.get(address)
    if kept is not None and kept[0] == count and kept[1] is dtype:
        return kept[2]
    whole = x.numpy().reshape(-1)
    if not count:
        return whole
    if kept is None and address not in _CALL_VIEWS_SEEN:
        # First sight of this address: a view made now would cost more than x.numpy() (buffers
        # allocated afresh every call never come back); keep one from the second sight on.
        if len(_CALL_VIEWS_SEEN) >= _CALL_VIEWS_KEPT:
            _CALL_VIEWS_SEEN.clear()
        _CALL_VIEWS_SEEN.add(address)
        return whole
    # Over the bytes, not over the tensor (ctypes memory that owns nothing), so the view keeps
    # nothing alive.
    view = np.frombuffer((ctypes.c_char * whole.nbytes).from_address(address), whole.dtype)
    if len(_CALL_VIEWS) >= _CALL_VIEWS_KEPT:
        _CALL_VIEWS.clear()
    _CALL_VIEWS[address] = (count, dtype, view)
    return view


def plain_tensor_over(arr: np.ndarray) -> Any:
    """A CPU tensor sharing arr's memory, for results of inputs plain_cpu_tensor_view took."""
    return _FROM_NUMPY(arr)


def numpy_to_torch(arr: np.ndarray, device: Any = None) -> Any:
    import torch

    if arr.dtype == BFLOAT16:
        t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    elif arr.dtype in (np.uint16, np.uint32, np.uint64):
        signed = {np.dtype(np.uint16): np.int16, np.dtype(np.uint32): np.int32, np.dtype(np.uint64): np.int64}[arr.dtype]
        target = {np.dtype(np.uint16): torch.uint16, np.dtype(np.uint32): torch.uint32, np.dtype(np.uint64): torch.uint64}[arr.dtype]
        t = torch.from_numpy(arr.view(signed)).view(target)
    else:
        t = torch.from_numpy(arr)
    if device is not None and torch.device(device).type != "cpu":
        t = t.to(device)
    return t


def as_numpy(x: Any) -> tuple[np.ndarray, Restore]:
    """A C-contiguous numpy view of x, and a function turning a numpy result back into x's type."""
    kind = gpu.library_of(x)
    if kind != "numpy" and gpu.is_cuda_array(x):
        # GPU buffers for host backends: one copy into pinned memory, one copy back.
        arr = gpu.stage_to_host(x)
        restore: Restore = lambda out, like=x: gpu.to_device(out, like)  # noqa: E731
    elif kind == "torch":
        arr = _torch_to_numpy(x)
        restore = numpy_to_torch
    else:
        arr = np.asarray(x)
        if not arr.dtype.isnative:  # big-endian data (read from a file, say): one native copy
            arr = arr.astype(arr.dtype.newbyteorder("="))
        if not arr.flags.c_contiguous:  # (ascontiguousarray would also turn a 0-d array into 1-d)
            arr = np.ascontiguousarray(arr)
        restore = _identity
    if arr.dtype not in DTYPE_CODES:
        raise TypeError(f"dtype {arr.dtype} is not supported (supported: {', '.join(sorted(map(str, DTYPE_CODES)))})")
    return arr, restore


def _identity(out: np.ndarray) -> np.ndarray:
    return out


def numpy_dtype(dtype: Any) -> np.dtype:
    """A numpy dtype from a numpy dtype, a string such as 'bfloat16', or a torch dtype."""
    if type(dtype).__module__.startswith("torch"):
        import torch

        if dtype == torch.bfloat16:
            return BFLOAT16
        return np.dtype(str(dtype).replace("torch.", ""))
    if isinstance(dtype, str) and dtype == "bfloat16":
        return BFLOAT16
    return np.dtype(dtype)


def result_like(dtype: Any) -> Restore:
    """How to wrap a received numpy array so it matches the kind of dtype the caller named."""
    if type(dtype).__module__.startswith("torch"):
        return numpy_to_torch
    return _identity


def flat(arr: np.ndarray) -> np.ndarray:
    """A 1-D view of a C-contiguous array (never a copy)."""
    return arr.reshape(-1)
