"""reduce_rows, the one-step shared-memory reduction: the same bits as numpy's ufunc.reduce over
the rank axis (rank order) for every op, dtype, group size and length around the switch between
one ufunc.reduce and one binary call per row."""
from __future__ import annotations

import numpy as np
import pytest

from adapter.backends.base import ReduceOp
from adapter.backends.local import algorithms as shm_algorithms
from adapter.backends.local.algorithms import _UFUNCS, reduce_rows

SWITCH = shm_algorithms._CHAIN_ELEMENTS


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("count", [1, SWITCH - 1, SWITCH, SWITCH + 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.int32, np.uint8, np.int64])
def test_same_bits_as_ufunc_reduce_in_rank_order(ranks, count, dtype):
    rng = np.random.default_rng(ranks * 1000 + count)
    rows = (rng.standard_normal((ranks, count)) * 1e3).astype(dtype)
    if rows.dtype.kind == "f":
        rows[0, :3] = [np.inf, np.nan, 3e38] if count >= 3 else rows[0, :3]
        rows[1, :1] = 3e38 if count >= 1 else rows[1, :1]
    for op in ReduceOp:
        if rows.dtype.kind in "fc" and op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
            continue
        if rows.dtype.kind == "c" and op in (ReduceOp.MAX, ReduceOp.MIN):
            continue
        expected = np.empty(count, dtype)
        with np.errstate(all="ignore"):
            _UFUNCS[op].reduce(rows, axis=0, out=expected)
        got = np.empty(count, dtype)
        reduce_rows(got, rows, op)
        assert got.tobytes() == expected.tobytes(), (op, ranks, count, dtype)
