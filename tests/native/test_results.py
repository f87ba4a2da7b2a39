"""The native engine's results, bit for bit, against numpy references reduced in rank order
(the order matters: float sums of values of very different sizes, float16/bfloat16 accumulated
in float32 and rounded once, NaN and inf, integer wrap-around), for every dtype and op, on the
one-step, the chunked pipelined and the streamed (non-temporal stores) paths, and for
reduce_scatter, all_gather and broadcast.
The members run as threads of this process over one real segment (segments.py)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from engine_segments import CHUNK, attach, together

from adapter.backends.base import ReduceOp
from adapter.errors import MismatchError

BF16 = np.dtype(ml_dtypes.bfloat16)
STREAMED = 256 * 1024  # bytes: csrc/shm/copy.h's JL_STREAM_MIN_BYTES
ONE_STEP = 64 * 1024  # bytes: its JL_STREAM_ONE_STEP_MIN_BYTES
DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
          np.float16, BF16, np.float32, np.float64, np.complex64, np.complex128]
UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum,
          ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}
BOOL = {ReduceOp.SUM: np.logical_or, ReduceOp.PROD: np.logical_and, ReduceOp.MAX: np.logical_or,
        ReduceOp.MIN: np.logical_and, ReduceOp.BAND: np.logical_and, ReduceOp.BOR: np.logical_or,
        ReduceOp.BXOR: np.logical_xor}


def defined(dt: np.dtype, op: ReduceOp) -> bool:
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and dt.kind not in "biu":
        return False
    return not (op in (ReduceOp.MAX, ReduceOp.MIN) and dt.kind == "c")


def reference(parts: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """op over parts in rank order, the way numpy computes it element by element."""
    dt = parts[0].dtype
    with np.errstate(all="ignore"):
        if dt in (np.dtype(np.float16), BF16):
            acc = parts[0].astype(np.float32)
            for p in parts[1:]:
                acc = UFUNCS[op](acc, p.astype(np.float32))
            return acc.astype(dt)
        ufunc = BOOL[op] if dt == np.bool_ else UFUNCS[op]
        acc = parts[0].copy()
        for p in parts[1:]:
            acc = ufunc(acc, p)
        return acc.astype(dt)


def inputs(ranks: int, count: int, dt: np.dtype, seed: int) -> list[np.ndarray]:
    """Values whose reduction order shows: magnitudes from 1e-3 to 1e6 (sums lose different low
    bits in a different order), NaN, inf and overflow in floats, wrap-around in integers."""
    rng = np.random.default_rng(seed)
    out = []
    for q in range(ranks):
        if dt == np.bool_:
            x = rng.random(count) > 0.5
        elif dt.kind in "iu":
            info = np.iinfo(dt)
            x = rng.integers(info.min, info.max, count, dtype=dt, endpoint=True)
        else:
            scale = 10.0 ** rng.integers(-3, 7, count)
            x = rng.standard_normal(count) * scale
            if dt.kind == "c":
                x = x + 1j * rng.standard_normal(count) * scale
            with np.errstate(over="ignore"):  # large values overflow float16 to inf: wanted
                x = x.astype(dt)
            if count > 4 and q == 0:
                x[:3] = [np.nan, np.inf, -np.inf]
            if count > 4 and q == 1:
                x[3] = np.finfo(np.float16).max if dt.itemsize == 2 and dt != BF16 else 3e38
        out.append(np.ascontiguousarray(x))
    return out


def run_all_reduce(ranks: int, count: int, dt: np.dtype, op: ReduceOp, small: int, inplace: bool) -> None:
    groups = attach(ranks, small=small)
    try:
        xs = inputs(ranks, count, dt, seed=ranks * 7919 + count)
        expected = reference(xs, op)
        srcs = [x.copy() for x in xs]
        dsts = [s if inplace else np.empty_like(s) for s in srcs]
        results = together(groups, lambda g: g.all_reduce(None, srcs[g.rank], dsts[g.rank], op))
        assert results == [None] * ranks, results
        for q in range(ranks):
            assert dsts[q].tobytes() == expected.tobytes(), (q, dt, op, count)
    finally:
        for g in groups:
            g.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_and_op_one_step_and_chunked(dtype):
    dt = np.dtype(dtype)
    item = dt.itemsize
    # one step (small), several chunks (each CHUNK // item elements, an uneven split per member)
    counts = [0, 1, 37, 3 * CHUNK // item + 5]
    for op in ReduceOp:
        if not defined(dt, op):
            continue
        for count in counts:
            for ranks in (2, 3):
                run_all_reduce(ranks, count, dt, op, small=16 * 1024, inplace=count % 2 == 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_and_op_streamed(dtype):
    """Past copy.h's JL_STREAM_MIN_BYTES (chunked) and JL_STREAM_ONE_STEP_MIN_BYTES (one step), a
    fresh segment's all-reduces 3-8 and 9-14 are its trials of plain and non-temporal stores
    (copy.c): both give numpy's bytes, on member slots that do not start on a cache line (3
    members)."""
    dt = np.dtype(dtype)
    paths = {"chunked": (dict(), STREAMED // dt.itemsize + 5),
             "one step": (dict(chunk=2 * ONE_STEP, small=2 * ONE_STEP), ONE_STEP // dt.itemsize + 5)}
    for path, (segment, count) in paths.items():
        for ranks in (2, 3):
            xs = inputs(ranks, count, dt, seed=ranks * 104729 + count)
            groups = attach(ranks, **segment)
            try:
                for op in ReduceOp:
                    if not defined(dt, op):
                        continue
                    expected = reference(xs, op).tobytes()
                    # every call checked: over the ops (2 at least), the segment's calls 3-8
                    # are its plain trials and 9-14 its streamed ones
                    for call in range(7):
                        dsts = [np.empty_like(x) for x in xs]
                        assert together(groups, lambda g: g.all_reduce(None, xs[g.rank], dsts[g.rank], op)) == [None] * ranks
                        for q in range(ranks):
                            assert dsts[q].tobytes() == expected, (path, q, dt, op, call)
            finally:
                for g in groups:
                    g.close()


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("large", [False, True], ids=["chunked", "streamed"])
def test_reduce_scatter_all_gather_broadcast(ranks, large):
    groups = attach(ranks)
    try:
        for dt in (np.dtype(np.float32), BF16, np.dtype(np.int16)):
            # more than one step; large: past JL_STREAM_MIN_BYTES (streamed once the segment's
            # timing chose non-temporal stores, always in the sanitizer build)
            m = (STREAMED if large else CHUNK) // dt.itemsize + 3
            xs = inputs(ranks, ranks * m, dt, seed=ranks)
            out = [np.empty(m, dt) for _ in range(ranks)]
            assert together(groups, lambda g: g.reduce_scatter(None, xs[g.rank], out[g.rank], ReduceOp.SUM)) == [None] * ranks
            full = reference(xs, ReduceOp.SUM)
            for q in range(ranks):
                assert out[q].tobytes() == full[q * m:(q + 1) * m].tobytes()
            gathered = [np.empty(ranks * m, dt) for _ in range(ranks)]
            assert together(groups, lambda g: g.all_gather(None, out[g.rank], gathered[g.rank])) == [None] * ranks
            for q in range(ranks):
                assert gathered[q].tobytes() == full.tobytes()
            bufs = [x[:m].copy() for x in xs]
            assert together(groups, lambda g: g.broadcast(None, bufs[g.rank], ranks - 1)) == [None] * ranks
            for q in range(ranks):
                assert bufs[q].tobytes() == xs[ranks - 1][:m].tobytes()
    finally:
        for g in groups:
            g.close()


def test_a_header_mismatch_raises_on_every_member_with_the_peers_header():
    groups = attach(2)
    try:
        headers = [bytes([1] * 24), bytes([2] * 24)]
        results = together(groups, lambda g: g.barrier(headers[g.rank]))
        for q, exc in enumerate(results):
            assert isinstance(exc, MismatchError), exc
            assert headers[1 - q].hex() in str(exc), str(exc)  # the peer's header, described
    finally:
        for g in groups:
            g.close()
