"""Float MAX/MIN against numpy's own np.maximum/np.minimum over the ranks in rank order, on each
float dtype itself (not widened): every combination of +0.0, -0.0, NaN, -NaN, ±1 and ±inf across
the members, on the one-step and the chunked paths, each with plain and non-temporal stores.
Equal values of different sign are where loops differ: numpy's float32/float64 loops and
ml_dtypes' bfloat16 return the second of two equal values, numpy's float16 loop the first; a NaN
propagates, the first one when both are. Members run as threads over one real segment (engine_segments.py)."""
from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
from engine_segments import CHUNK, attach, together

from adapter.backends.base import ReduceOp

FLOATS = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float64)]
VALUES = [0.0, -0.0, np.nan, -np.nan, 1.0, -1.0, np.inf, -np.inf]
UFUNC = {ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}
STREAMED = 256 * 1024  # bytes: past copy.h's JL_STREAM_MIN_BYTES
ONE_STEP = 64 * 1024  # bytes: its JL_STREAM_ONE_STEP_MIN_BYTES


def columns(ranks: int, dt: np.dtype, count: int) -> list[np.ndarray]:
    """Member q's values: every combination of VALUES over the members, repeated up to count."""
    combos = np.array(list(itertools.product(VALUES, repeat=ranks)), dtype=np.float64)
    reps = -(-count // len(combos))
    return [np.ascontiguousarray(np.tile(combos[:, q], reps)[:count].astype(dt)) for q in range(ranks)]


def numpy_rank_order(parts: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    acc = parts[0].copy()
    with np.errstate(invalid="ignore"):  # NaN inputs are the point
        for p in parts[1:]:
            acc = UFUNC[op](acc, p)
    return acc


@pytest.mark.parametrize("dt", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("ranks", [2, 3])
def test_max_min_with_signed_zeros_and_nans_match_numpy(dt, ranks):
    item = dt.itemsize
    bits = np.dtype(f"u{item}")
    paths = {"one step": (len(VALUES) ** ranks, {}), "chunked": (3 * CHUNK // item + 5, {}),
             "streamed": (STREAMED // item + 7, {}),
             "one step streamed": (ONE_STEP // item + 7, dict(chunk=2 * ONE_STEP, small=2 * ONE_STEP))}
    for path, (count, segment) in paths.items():
        xs = columns(ranks, dt, count)
        for op in (ReduceOp.MAX, ReduceOp.MIN):
            expected = numpy_rank_order(xs, op).view(bits)
            groups = attach(ranks, **segment)
            try:
                # A fresh segment's large all-reduces 3-8 use plain stores, 9-14 non-temporal
                # ones (copy.c's trials): the first and the ninth here.
                for call in range(9):
                    if call not in (0, 8):
                        together(groups, lambda g: g.all_reduce(None, xs[g.rank], np.empty_like(xs[g.rank]), op))
                        continue
                    outs = [np.empty_like(x) for x in xs]
                    assert together(groups, lambda g: g.all_reduce(None, xs[g.rank], outs[g.rank], op)) == [None] * ranks
                    for q in range(ranks):
                        wrong = np.nonzero(outs[q].view(bits) != expected)[0]
                        assert wrong.size == 0, (
                            f"{dt.name} {op.name} {path} call {call} member {q}: at {wrong[:4].tolist()} got "
                            f"{[hex(v) for v in outs[q].view(bits)[wrong[:4]]]}, numpy "
                            f"{[hex(v) for v in expected[wrong[:4]]]}")
            finally:
                for g in groups:
                    g.close()
