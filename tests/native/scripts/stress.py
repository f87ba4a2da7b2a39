"""A randomized stress of the shared-memory engine, run by every rank of a same-host job (the
sanitizer test starts it): random sizes (one step to several chunks), dtypes, ops and
collectives, every result checked against numpy; then, when STRESS_KILL is set, the last rank
dies by SIGKILL inside a collective and every survivor must raise PeerError naming it."""
import os
import signal
import sys

import ml_dtypes
import numpy as np

import adapter
from adapter.errors import PeerError

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int32, np.uint8, np.int64, np.complex64,
          np.bool_]
OPS = {"sum": (adapter.all_sum, np.add), "max": (adapter.all_max, np.maximum), "min": (adapter.all_min, np.minimum)}

world = adapter.init()
rank, n = world.rank(), world.size()
rng = np.random.default_rng(int(os.environ.get("STRESS_SEED", "1")))  # the same draws on every rank
for i in range(int(os.environ.get("STRESS_ROUNDS", "40"))):
    dt = np.dtype(DTYPES[rng.integers(len(DTYPES))])
    count = int(rng.choice([0, 1, 7, 1000, 40_000, 700_000]))
    kind = rng.choice(["all_reduce", "all_gather", "broadcast"])
    op = str(rng.choice(list(OPS)))
    if dt.kind in "cb" and op != "sum":
        op = "sum"
    xs = [np.random.default_rng(i * 100 + q).integers(0, 50, count).astype(dt) for q in range(n)]
    if kind == "all_reduce":
        call, ufunc = OPS[op]
        got = call(xs[rank])
        if dt in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
            acc = xs[0].astype(np.float32)
            for x in xs[1:]:
                acc = ufunc(acc, x.astype(np.float32))
            want = acc.astype(dt)
        else:
            want = xs[0].copy()
            for x in xs[1:]:
                want = (np.logical_or if dt == np.bool_ else ufunc)(want, x).astype(dt)
    elif kind == "all_gather":
        got = adapter.all_gather(xs[rank])
        want = np.concatenate(xs)
    else:
        got = adapter.broadcast(xs[rank], root=n - 1)
        want = xs[n - 1]
    assert np.asarray(got).tobytes() == want.tobytes(), (i, kind, op, dt, count)
print(f"rank {rank}: stress ok", flush=True)
if os.environ.get("STRESS_KILL"):
    x = np.ones(1_000_000, np.float32)
    if rank == n - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(50):
            adapter.all_sum(x)
    except PeerError as exc:
        assert f"rank {n - 1}" in str(exc), exc
        print(f"rank {rank}: saw the kill", flush=True)
        sys.exit(0)
    sys.exit(f"rank {rank}: no PeerError after rank {n - 1} died")
