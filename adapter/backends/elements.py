"""Element types and reductions shared by every backend that reduces on the CPU.

float16 and bfloat16 are reduced in float32 and rounded once per step, so a sum of
many ranks loses no more precision than one rounding per hop.
"""
from __future__ import annotations

from typing import Callable

import ml_dtypes
import numpy as np

from .base import ReduceOp

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# Stable wire codes: two ranks compare these to detect a dtype mismatch.
DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype(np.bool_): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.uint8): 6,
    np.dtype(np.uint16): 7,
    np.dtype(np.uint32): 8,
    np.dtype(np.uint64): 9,
    np.dtype(np.float16): 10,
    BFLOAT16: 11,
    np.dtype(np.float32): 12,
    np.dtype(np.float64): 13,
    np.dtype(np.complex64): 14,
    np.dtype(np.complex128): 15,
}
CODE_NAMES = {code: str(dt) for dt, code in DTYPE_CODES.items()}

_WIDEN = {np.dtype(np.float16), BFLOAT16}

# Overflow to inf and inf - inf = nan are the IEEE answers a float reduction should give (as
# MLX, torch and MPI give them), not reasons to print numpy RuntimeWarnings from library code.
def _quiet() -> np.errstate:
    return np.errstate(over="ignore", invalid="ignore")

_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
# numpy's add on bool is logical or; spell the boolean meaning of each op out.
_BOOL_UFUNCS = {
    ReduceOp.SUM: np.logical_or,
    ReduceOp.PROD: np.logical_and,
    ReduceOp.MAX: np.logical_or,
    ReduceOp.MIN: np.logical_and,
    ReduceOp.BAND: np.logical_and,
    ReduceOp.BOR: np.logical_or,
    ReduceOp.BXOR: np.logical_xor,
}

# np.errstate builds a new error state on every entry, which costs more than a small reduction.
# numpy 2 keeps that state in a context variable: quiet_call and quiet_ufunc set the quiet version of the
# caller's state (derived once per state through np.errstate itself) for one call and resets it.
try:
    from numpy._core.umath import _extobj_contextvar as _ERRSTATE
except ImportError:  # numpy 1.x: np.errstate every time
    _ERRSTATE = None
_quiet_states: dict = {}  # the caller's state -> its quiet version (the key keeps it alive)


def _quiet_state(state: object) -> object:
    """The quiet version of the error state `state` (the current one)."""
    with _quiet():
        quiet = _ERRSTATE.get()
    if len(_quiet_states) >= 16:
        _quiet_states.clear()
    _quiet_states[state] = quiet
    return quiet


def quiet_call(fn: Callable[..., object], *args: object) -> None:
    """fn(*args) with float overflow and invalid results unreported, as under _quiet()."""
    if _ERRSTATE is None:
        with _quiet():
            fn(*args)
        return
    state = _ERRSTATE.get()
    token = _ERRSTATE.set(_quiet_states.get(state) or _quiet_state(state))
    try:
        fn(*args)
    finally:
        _ERRSTATE.reset(token)


def quiet_ufunc(ufunc: np.ufunc, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """ufunc(a, b, out=out) as quiet_call would run it (the common case, without *args)."""
    if _ERRSTATE is None:
        with _quiet():
            ufunc(a, b, out=out)
        return
    state = _ERRSTATE.get()
    token = _ERRSTATE.set(_quiet_states.get(state) or _quiet_state(state))
    try:
        ufunc(a, b, out=out)
    finally:
        _ERRSTATE.reset(token)


def dtype_code(dtype: np.dtype) -> int:
    try:
        return DTYPE_CODES[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported by jacklring") from None


def check_reducible(dtype: np.dtype, op: ReduceOp) -> None:
    """Raise TypeError for a combination numpy cannot reduce (bitwise ops on floats, max of complex)."""
    dt = np.dtype(dtype)
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and dt.kind not in "biu":
        raise TypeError(f"{op.name} needs an integer or bool dtype, not {dt}")
    if op in (ReduceOp.MAX, ReduceOp.MIN) and dt.kind == "c":
        raise TypeError(f"{op.name} is not defined for complex dtype {dt}")


def reduce_into(dst: np.ndarray, a: np.ndarray, b: np.ndarray, op: ReduceOp) -> None:
    """dst = op(a, b) elementwise; dst may alias a or b."""
    if dst.dtype.kind in "fcV":  # floats, complex, and ml_dtypes' bfloat16 (kind "V")
        with _quiet():
            _reduce_into(dst, a, b, op)
    else:
        _reduce_into(dst, a, b, op)


def _reduce_into(dst: np.ndarray, a: np.ndarray, b: np.ndarray, op: ReduceOp) -> None:
    dt = dst.dtype
    if dt in _WIDEN:
        wide = _UFUNCS[op](a.astype(np.float32), b.astype(np.float32))
        dst[...] = wide.astype(dt)
    elif dt == np.bool_:
        _BOOL_UFUNCS[op](a, b, out=dst)
    else:
        _UFUNCS[op](a, b, out=dst)


def reduce_many(dst: np.ndarray, parts: list[np.ndarray], op: ReduceOp) -> None:
    """dst = op over parts in list order (a fixed order gives bit-identical results on every rank).

    dst may alias parts[0], never a later part.
    """
    if dst.dtype.kind in "fcV":
        with _quiet():
            _reduce_many(dst, parts, op)
    else:
        _reduce_many(dst, parts, op)


def _reduce_many(dst: np.ndarray, parts: list[np.ndarray], op: ReduceOp) -> None:
    if dst.dtype in _WIDEN:
        acc = parts[0].astype(np.float32)
        ufunc = _UFUNCS[op]
        for part in parts[1:]:
            ufunc(acc, part.astype(np.float32), out=acc)
        dst[...] = acc.astype(dst.dtype)
        return
    if len(parts) == 1:
        dst[...] = parts[0]
        return
    _reduce_into(dst, parts[0], parts[1], op)
    for part in parts[2:]:
        _reduce_into(dst, dst, part, op)


# ---- views and blocks of flat buffers -----------------------------------------------------------

def byte_view(arr: np.ndarray) -> memoryview:
    """A writable flat byte view of a C-contiguous array, without copying (bfloat16 included:
    numpy's buffer protocol does not know ml_dtypes, a uint8 view does)."""
    return memoryview(arr.reshape(-1).view(np.uint8))


def block_bounds(count: int, parts: int) -> list[int]:
    """parts + 1 boundaries of contiguous blocks covering [0, count), sizes differing by at most
    one (the first count % parts blocks are the larger)."""
    base, extra = divmod(count, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """The (start, end) of each block of block_bounds(count, parts)."""
    bounds = block_bounds(count, parts)
    return list(zip(bounds[:-1], bounds[1:]))
