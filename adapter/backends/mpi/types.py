"""numpy dtypes and ReduceOps as MPI datatypes and MPI reduction ops.

Import only after MPI is initialized (adapter.backends.mpi.backend.create does that).

MPI has no float16 or bfloat16 type. Those travel as a contiguous type of 2 bytes and are
reduced by user-defined ops that call elements.reduce_into on a numpy view of MPI's buffers,
so they round exactly as the other backends do (in float32, one rounding per step).
bool maps to C_BOOL with the logical ops spelled out in elements._BOOL_UFUNCS.
MAX and MIN of float32/float64 are user-defined ops too: MPI's own MAX is `a > b ? a : b`,
which drops a NaN depending on the order of the operands, while every other backend (numpy's
maximum) propagates it. They cost a Python call per incoming block.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
from mpi4py import MPI

from ..base import ReduceOp
from ..elements import BFLOAT16, check_reducible, reduce_into

NATIVE_TYPES: dict[np.dtype, Any] = {
    np.dtype(np.bool_): MPI.C_BOOL,
    np.dtype(np.int8): MPI.INT8_T,
    np.dtype(np.int16): MPI.INT16_T,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int64): MPI.INT64_T,
    np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.uint16): MPI.UINT16_T,
    np.dtype(np.uint32): MPI.UINT32_T,
    np.dtype(np.uint64): MPI.UINT64_T,
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.complex64): MPI.C_FLOAT_COMPLEX,
    np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX,
}
# Reduced by Python callbacks; the buffer protocol cannot export bfloat16, so these travel as uint8 views.
USER_REDUCED = (np.dtype(np.float16), BFLOAT16)

_NATIVE_OPS = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.PROD: MPI.PROD,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.BAND: MPI.BAND,
    ReduceOp.BOR: MPI.BOR,
    ReduceOp.BXOR: MPI.BXOR,
}
_BOOL_OPS = {
    ReduceOp.SUM: MPI.LOR,
    ReduceOp.PROD: MPI.LAND,
    ReduceOp.MAX: MPI.LOR,
    ReduceOp.MIN: MPI.LAND,
    ReduceOp.BAND: MPI.LAND,
    ReduceOp.BOR: MPI.LOR,
    ReduceOp.BXOR: MPI.LXOR,
}

# Ops whose MPI builtin for floats does not propagate NaN as numpy (and the other backends) do.
_NAN_PROPAGATING = (ReduceOp.MAX, ReduceOp.MIN)

_lock = threading.Lock()
_byte_types: dict[int, Any] = {}
# (dtype, op) -> (MPI datatype, MPI op, needs a uint8 view). MPI objects live as long as MPI does.
_reductions: dict[tuple[np.dtype, ReduceOp], tuple[Any, Any, bool]] = {}
_transfers: dict[np.dtype, tuple[Any, bool]] = {}


def transfer_type(dtype: np.dtype) -> tuple[Any, bool]:
    """(MPI datatype, whether to pass a uint8 view) for moving elements of dtype unchanged."""
    try:
        return _transfers[dtype]
    except KeyError:
        pass
    if dtype in NATIVE_TYPES:
        entry = (NATIVE_TYPES[dtype], False)
    elif dtype in USER_REDUCED:
        entry = (_byte_type(dtype.itemsize), True)
    else:
        raise TypeError(f"dtype {dtype} is not supported by the MPI backend")
    with _lock:
        _transfers[dtype] = entry
    return entry


def reduction(dtype: np.dtype, op: ReduceOp) -> tuple[Any, Any, bool]:
    """(MPI datatype, MPI op, whether to pass a uint8 view) for reducing dtype with op."""
    try:
        return _reductions[(dtype, op)]
    except KeyError:
        pass
    check_reducible(dtype, op)
    mpi_type, as_bytes = transfer_type(dtype)
    if dtype == np.bool_:
        mpi_op = _BOOL_OPS[op]
    elif dtype in USER_REDUCED or (dtype.kind == "f" and op in _NAN_PROPAGATING):
        mpi_op = _user_op(dtype, op)
    else:
        mpi_op = _NATIVE_OPS[op]
    with _lock:
        entry = _reductions.setdefault((dtype, op), (mpi_type, mpi_op, as_bytes))
    return entry


def _byte_type(itemsize: int) -> Any:
    with _lock:
        if itemsize not in _byte_types:
            _byte_types[itemsize] = MPI.BYTE.Create_contiguous(itemsize).Commit()
        return _byte_types[itemsize]


def _user_op(dtype: np.dtype, op: ReduceOp) -> Any:
    def combine(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        # MPI's contract: inoutbuf = inbuf op inoutbuf, in place.
        incoming = np.frombuffer(inbuf, dtype)
        accumulated = np.frombuffer(inoutbuf, dtype)
        reduce_into(accumulated, incoming, accumulated, op)

    mpi_op = MPI.Op.Create(combine, commute=True)
    # Commutative lets Open MPI pick its fast allreduce algorithms; our ops are (a op b == b op a).
    if not mpi_op.Is_commutative():
        raise RuntimeError(f"MPI did not register the {op.name} op for {dtype} as commutative")
    return mpi_op
