"""Inputs every rank can compute for every other rank, numpy references, and comparisons.

Values are small integers, so every sum and product over four ranks is exact even in
float16 and bfloat16: a reference is right whatever order a backend reduces in.
"""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from adapter import ReduceOp

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, BF16, np.float32, np.float64, np.complex64, np.complex128)]
BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
ORDERED = (ReduceOp.MAX, ReduceOp.MIN)
_BOOL_REFERENCE = {
    ReduceOp.SUM: np.logical_or, ReduceOp.PROD: np.logical_and, ReduceOp.MAX: np.logical_or,
    ReduceOp.MIN: np.logical_and, ReduceOp.BAND: np.logical_and, ReduceOp.BOR: np.logical_or,
    ReduceOp.BXOR: np.logical_xor,
}
_REFERENCE = {
    ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum,
    ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor,
}


def is_floating(dtype: np.dtype) -> bool:
    return dtype.kind in "fc" or dtype == BF16


def valid_ops(dtype: np.dtype) -> list[ReduceOp]:
    """The reductions the library defines for dtype: bitwise ones on integers and bool only,
    MAX/MIN on everything but complex."""
    ops = list(ReduceOp)
    if dtype.kind not in "biu":
        ops = [op for op in ops if op not in BITWISE]
    if dtype.kind == "c":
        ops = [op for op in ops if op not in ORDERED]
    return ops


def data(rank: int, dtype: np.dtype, count: int, salt: int = 0) -> np.ndarray:
    """count small integers in dtype, distinct per (rank, dtype, count, salt)."""
    rng = np.random.default_rng([rank, DTYPES.index(dtype) if dtype in DTYPES else 99, count, salt])
    if dtype == np.bool_:
        return rng.integers(0, 2, count).astype(bool)
    values = rng.integers(0 if dtype.kind == "u" else -3, 4, count)
    if dtype.kind == "c":
        return (values + 1j * rng.integers(-3, 4, count)).astype(dtype)
    return values.astype(dtype)


def _wide(dtype: np.dtype) -> type:
    if dtype == BF16:  # ml_dtypes reports kind 'V'
        return np.float64
    return {"i": np.int64, "u": np.uint64, "f": np.float64, "c": np.complex128}[dtype.kind]


def reference(parts: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """op over parts, accumulated wide and cast back (numpy's own result for the dtype)."""
    dtype = parts[0].dtype
    if dtype == np.bool_:
        acc = parts[0].copy()
        for part in parts[1:]:
            acc = _BOOL_REFERENCE[op](acc, part)
        return acc
    acc = parts[0].astype(_wide(dtype))
    for part in parts[1:]:
        acc = _REFERENCE[op](acc, part.astype(_wide(dtype)))
    return acc.astype(dtype)


def to_numpy(x: Any) -> np.ndarray:
    """A numpy array of x's values (torch tensors of any dtype included), without the library's help."""
    if type(x).__module__.startswith("torch"):
        import torch

        t = x.detach().resolve_conj().resolve_neg().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(BF16)
        unsigned = {torch.uint16: (torch.int16, np.uint16), torch.uint32: (torch.int32, np.uint32),
                    torch.uint64: (torch.int64, np.uint64)}
        if t.dtype in unsigned:
            signed, target = unsigned[t.dtype]
            return t.view(signed).numpy().view(target)
        return t.numpy()
    return np.asarray(x)


def to_torch(arr: np.ndarray) -> Any:
    """A CPU tensor holding arr's values (bfloat16 and the unsigned types included)."""
    import torch

    arr = np.ascontiguousarray(arr)
    if arr.dtype == BF16:
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    unsigned = {np.dtype(np.uint16): (np.int16, torch.uint16), np.dtype(np.uint32): (np.int32, torch.uint32),
                np.dtype(np.uint64): (np.int64, torch.uint64)}
    if arr.dtype in unsigned:
        signed, target = unsigned[arr.dtype]
        return torch.from_numpy(arr.view(signed).copy()).view(target)
    return torch.from_numpy(arr.copy())


def equal(got: Any, want: Any) -> bool:
    """Same dtype, shape and values (NaN equals NaN; -0.0 equals 0.0)."""
    got, want = to_numpy(got), to_numpy(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if is_floating(got.dtype):
        wide = np.complex128 if got.dtype.kind == "c" else np.float64
        return bool(np.array_equal(got.astype(wide), want.astype(wide), equal_nan=True))
    return bool(np.array_equal(got, want))


def describe(x: Any) -> str:
    arr = to_numpy(x)
    return f"{arr.dtype}{arr.shape} {arr.ravel()[:6]}"
