"""How each numpy dtype and ReduceOp reaches NCCL: pure data, no cupy needed.

NCCL's enums are part of its ABI (nccl.h), so the numbers are fixed here and checked
against cupy.cuda.nccl's constants by the GPU tests.

NCCL has no 16-bit integers, no bool, no complex and no bitwise reductions. Each gap is
closed exactly where an exact answer exists:
  - int16 / uint16 are widened to 32 bits on the device, reduced, and narrowed back
    (wrap-around arithmetic modulo 2**16 gives the same bits as reducing in 16 bits);
  - bool travels as uint8 with the boolean meaning of each op (sum/max/bor = or,
    prod/min/band = and), the same meanings elements.py gives on the CPU;
  - complex travels as pairs of reals, for sum only (a product of pairs is not a pair of products).
Everything else raises TypeError naming the op and dtype. Data movement (all_gather,
broadcast, send/recv) never needs this table: it moves bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..base import ReduceOp
from ..elements import BFLOAT16

# ncclDataType_t
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
# ncclRedOp_t (ncclAvg = 4 exists; AVG is computed above the backend as a sum and a division)
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3

NCCL_DTYPES: dict[np.dtype, int] = {
    np.dtype(np.int8): NCCL_INT8,
    np.dtype(np.uint8): NCCL_UINT8,
    np.dtype(np.int32): NCCL_INT32,
    np.dtype(np.uint32): NCCL_UINT32,
    np.dtype(np.int64): NCCL_INT64,
    np.dtype(np.uint64): NCCL_UINT64,
    np.dtype(np.float16): NCCL_FLOAT16,
    np.dtype(np.float32): NCCL_FLOAT32,
    np.dtype(np.float64): NCCL_FLOAT64,
    BFLOAT16: NCCL_BFLOAT16,
}

NCCL_OPS: dict[ReduceOp, int] = {
    ReduceOp.SUM: NCCL_SUM,
    ReduceOp.PROD: NCCL_PROD,
    ReduceOp.MAX: NCCL_MAX,
    ReduceOp.MIN: NCCL_MIN,
}

# Bool as uint8: each op by its boolean meaning, all exact on 0/1 bytes.
BOOL_OPS: dict[ReduceOp, int] = {
    ReduceOp.SUM: NCCL_MAX,
    ReduceOp.MAX: NCCL_MAX,
    ReduceOp.BOR: NCCL_MAX,
    ReduceOp.PROD: NCCL_MIN,
    ReduceOp.MIN: NCCL_MIN,
    ReduceOp.BAND: NCCL_MIN,
}

WIDEN: dict[np.dtype, np.dtype] = {
    np.dtype(np.int16): np.dtype(np.int32),
    np.dtype(np.uint16): np.dtype(np.uint32),
}

COMPLEX_PARTS: dict[np.dtype, np.dtype] = {
    np.dtype(np.complex64): np.dtype(np.float32),
    np.dtype(np.complex128): np.dtype(np.float64),
}


@dataclass(frozen=True)
class ReducePlan:
    """How to run one reduction: NCCL dtype and op, elements per input element, and the
    dtype to widen to on the device first (None when the buffer goes as it is)."""

    nccl_dtype: int
    nccl_op: int
    per_element: int = 1
    widen_to: np.dtype | None = None


def reduce_plan(dtype: np.dtype, op: ReduceOp) -> ReducePlan:
    """The plan for reducing `dtype` with `op` on NCCL, or TypeError naming both."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        if op not in BOOL_OPS:
            raise TypeError(f"NCCL has no {op.name} reduction for bool (supported: "
                            f"{', '.join(o.name for o in BOOL_OPS)})")
        return ReducePlan(NCCL_UINT8, BOOL_OPS[op])
    if op not in NCCL_OPS:
        raise TypeError(f"NCCL has no {op.name} reduction (it supports SUM, PROD, MAX, MIN; "
                        f"use the ring, jaccl or mpi backend for {op.name} on {dt})")
    if dt in COMPLEX_PARTS:
        if op is not ReduceOp.SUM:
            raise TypeError(f"NCCL reduces complex dtype {dt} with SUM only, not {op.name}")
        return ReducePlan(NCCL_DTYPES[COMPLEX_PARTS[dt]], NCCL_SUM, per_element=2)
    if dt in WIDEN:
        wide = WIDEN[dt]
        return ReducePlan(NCCL_DTYPES[wide], NCCL_OPS[op], widen_to=wide)
    if dt not in NCCL_DTYPES:
        raise TypeError(f"dtype {dt} cannot be reduced by NCCL")
    return ReducePlan(NCCL_DTYPES[dt], NCCL_OPS[op])


def nccl_dtype_name(code: int) -> str:
    for dt, c in NCCL_DTYPES.items():
        if c == code:
            return str(dt)
    return f"nccl dtype {code}"
