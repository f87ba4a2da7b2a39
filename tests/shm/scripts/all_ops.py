"""Every collective x representative dtypes x edge sizes against numpy references.

Inputs are a deterministic function of (rank, size), so each rank computes the expected
result locally. Exits non-zero with a message on the first wrong result.
"""
import sys

import ml_dtypes
import numpy as np

import adapter

SIZES = [int(s) for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [0, 1, 5, 1023, 70_001]
DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
          np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.complex64]

g = adapter.init(strict=True)
r, n = g.rank(), g.size()


def data(rank, count, dtype):
    base = (np.arange(count) * 7 + rank * 3) % 11
    if np.dtype(dtype) == np.bool_:
        return (base % 3 == 0)
    arr = base.astype(np.float64)
    if np.dtype(dtype).kind == "c":
        return (arr + 1j * (arr - rank)).astype(dtype)
    return arr.astype(dtype)


def check(name, got, want, exact=True):
    want = np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        sys.exit(f"rank {r}: {name}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
    if exact:
        ok = np.array_equal(got.astype(np.float64) if got.dtype.kind not in "bc" else got,
                            want.astype(np.float64) if want.dtype.kind not in "bc" else want)
    else:
        ok = np.allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-2)
    if not ok:
        sys.exit(f"rank {r}: {name}: wrong result\n got  {got.ravel()[:8]}\n want {want.ravel()[:8]}")


for count in SIZES:
    for dt in DTYPES:
        dt = np.dtype(dt)
        mine = data(r, count, dt)
        everyone = [data(q, count, dt) for q in range(n)]
        low_precision = dt in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
        # sums in float64 then cast, as a correctly accumulated reference
        if dt == np.bool_:
            want_sum = np.logical_or.reduce(everyone) if count else mine
        else:
            want_sum = np.sum([e.astype(np.complex128 if dt.kind == "c" else np.float64) for e in everyone], axis=0).astype(dt)
        check(f"all_sum {dt} x{count}", adapter.all_sum(mine), want_sum, exact=not low_precision)
        if dt.kind != "c":
            check(f"all_max {dt} x{count}", adapter.all_max(mine), np.max(everyone, axis=0) if count else mine)
            check(f"all_min {dt} x{count}", adapter.all_min(mine), np.min(everyone, axis=0) if count else mine)
        check(f"all_gather {dt} x{count}", adapter.all_gather(mine), np.concatenate(everyone))
        block = max(count // n, 1) * n if count else 0
        x = data(r, block, dt).reshape(n, -1) if block else np.zeros((0,), dt)
        if block:
            got = adapter.sum_scatter(x)
            full = np.sum([data(q, block, dt).reshape(n, -1).astype(np.complex128 if dt.kind == "c" else np.float64)
                           for q in range(n)], axis=0) if dt != np.bool_ else \
                np.logical_or.reduce([data(q, block, dt).reshape(n, -1) for q in range(n)])
            check(f"sum_scatter {dt} x{block}", got, full[r:r + 1].astype(dt), exact=not low_precision)
        root = count % n
        check(f"broadcast {dt} x{count} root {root}", adapter.broadcast(mine, root=root), everyone[root])
    if count:
        # integer ops beyond MLX: product and bitwise
        ints = data(r, count, np.int64) + 1
        ev = [data(q, count, np.int64) + 1 for q in range(n)]
        check("all_reduce prod", adapter.all_reduce(ints, "prod"), np.prod(ev, axis=0))
        check("all_reduce bxor", adapter.all_reduce(ints, "bxor"), np.bitwise_xor.reduce(ev))
        check("all_reduce band", adapter.all_reduce(ints, "band"), np.bitwise_and.reduce(ev))
        check("all_reduce bor", adapter.all_reduce(ints, "bor"), np.bitwise_or.reduce(ev))
adapter.barrier()
print(f"rank {r}: all ops ok")
