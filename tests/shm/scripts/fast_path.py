"""2 ranks over shared memory: adapter.all_reduce on numpy inputs (the ops fast path and the
planned one-step reduction) against numpy for every dtype, op and a few shapes, repeated so that
the cached plans and both step parities are used; then the inputs the general path refuses."""
import sys

import ml_dtypes
import numpy as np

import adapter
from adapter.backends.base import ReduceOp

g = adapter.init(strict=True)
r, n = g.rank(), g.size()
if g.backend.state.shm is None:
    sys.exit(f"rank {r}: expected shared memory")
DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
          np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.complex64, np.complex128]
UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum,
          ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}
BOOL = {ReduceOp.SUM: np.logical_or, ReduceOp.PROD: np.logical_and, ReduceOp.MAX: np.logical_or,
        ReduceOp.MIN: np.logical_and, ReduceOp.BAND: np.logical_and, ReduceOp.BOR: np.logical_or,
        ReduceOp.BXOR: np.logical_xor}


def data(rank, shape, dt):
    base = (np.arange(int(np.prod(shape))).reshape(shape) * 5 + rank * 3) % 7 + 1
    if dt == np.bool_:
        return base % 2 == 0
    if dt.kind == "c":
        return (base + 1j * rank).astype(dt)
    return base.astype(dt)


def want(shape, dt, op):
    parts = [data(q, shape, dt) for q in range(n)]
    if dt == np.bool_:
        return BOOL[op](parts[0], parts[1])
    wide = np.float32 if dt in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)) else dt
    return UFUNCS[op](parts[0].astype(wide), parts[1].astype(wide)).astype(dt)


def fail(text):
    sys.exit(f"rank {r}: {text}")


for shape in [(1,), (), (3, 5), (1000,), (2, 0)]:
    for dt in map(np.dtype, DTYPES):
        for op in ReduceOp:
            if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and dt.kind not in "biu":
                continue
            if op in (ReduceOp.MAX, ReduceOp.MIN) and dt.kind == "c":
                continue
            x = data(r, shape, dt)
            for _ in range(3):  # a cached plan, both parities
                got = adapter.all_reduce(x, op)
                if type(got) is not np.ndarray or got.shape != x.shape or got.dtype != dt:
                    fail(f"{op} {dt}{shape}: got {type(got).__name__} {getattr(got, 'dtype', '?')}{np.shape(got)}")
                if got.tobytes() != want(shape, dt, op).tobytes():
                    fail(f"{op} {dt}{shape}: {got.ravel()[:6]} != {want(shape, dt, op).ravel()[:6]}")

# Inputs the fast path must leave to the general path: the same results and the same errors.
x = np.arange(6, dtype=np.float32).reshape(2, 3)
for name, arr in [("non-contiguous", x.T), ("big-endian", x.astype(">f4")), ("list", x.tolist())]:
    got = adapter.all_sum(arr)
    if not np.array_equal(np.asarray(got, np.float32), np.asarray(x.T if name == "non-contiguous" else x) * n):
        fail(f"{name}: {got}")
for arr, op, error, words in [(np.ones(3, np.float32), ReduceOp.BAND, TypeError, "BAND needs an integer"),
                              (np.ones(3, np.complex64), ReduceOp.MAX, TypeError, "MAX is not defined"),
                              (np.ones(3, object), ReduceOp.SUM, TypeError, "not supported"),
                              (np.ones(3, "datetime64[s]"), ReduceOp.SUM, TypeError, "not supported")]:
    try:
        adapter.all_reduce(arr, op)
    except error as exc:
        if words not in str(exc):
            fail(f"{arr.dtype} {op}: unexpected message {exc}")
    else:
        fail(f"{arr.dtype} {op}: no {error.__name__}")
try:
    adapter.all_reduce(np.ones(3, np.float32), "average")
except ValueError as exc:
    if "unknown reduce op" not in str(exc):
        fail(f"bad op: {exc}")
else:
    fail("bad op accepted")
# The group still works after the refused inputs (none of them reached the other rank).
if adapter.all_sum(np.ones(1, np.float32))[0] != n:
    fail("group broken after refused inputs")
print(f"rank {r}: ok")
