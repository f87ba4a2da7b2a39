"""The engine's fast path (Group.fast, csrc/python/shell.c) beside the Python path, over shared
memory. argv[1] says what to check:

mix (2 ranks, ring or JACCL): the ranks mix out=x, fresh results, out=other, bfloat16 (fast) with
  non-contiguous and all_reduce(op) calls (Python path) in one job: bit-identical results, the same sequence
  number everywhere (the segment's), no mismatch; then another thread of rank 0 runs while rank
  0's fast call waits for a late rank 1 (the GIL is released); then a mismatch (different sizes)
  through the fast path on one sub-group and through the Python path on another: the same
  exception and words, and the same refusal afterwards.
dead (3 ranks): rank 2 exits while rank 0 waits in the fast path and rank 1 in the Python path:
  both raise PeerError naming rank 2, and the group refuses afterwards as today.

Under JACCL the sequence number is not read (its backend does not show it): a header packed apart
by the two paths shows as a mismatch in the mixed calls."""
import os
import sys
import threading
import time

import ml_dtypes
import numpy as np
from fast_job import fail, g, n, r, sequences_agree, state

import adapter
from adapter.errors import DistributedError, MismatchError, PeerError, failure_of


def data(q: int, size: int, dtype) -> np.ndarray:
    return ((np.arange(size) * 7 + q * 3) % 11 - 4).astype(dtype)


def want(size: int, dtype, op=np.add) -> np.ndarray:
    wide = np.float32 if np.dtype(dtype) in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)) else dtype
    total = data(0, size, wide)
    for q in range(1, n):
        total = op(total, data(q, size, wide))
    return total.astype(dtype)


def mix() -> None:
    for i in range(60):
        size = (1, 5, 1000, 70000)[i % 4]  # 70000 x 8 bytes: more than one chunk of the segment
        dtype = (np.float32, np.int64, np.float64, np.float16)[i % 4]
        x = data(r, size, dtype)
        how = (i + r) % 5  # the ranks take different paths for the same collective
        if how == 0:
            got = adapter.all_sum(x, out=x)  # fast, in place
        elif how == 1:
            got = adapter.all_sum(x)  # fast, a fresh result
        elif how == 2:
            got = adapter.all_sum(x, out=np.empty_like(x))  # fast, into another array
        elif how == 3:
            wide = np.zeros((size, 2), dtype)
            wide[:, 0] = x
            got = adapter.all_sum(wide[:, 0])  # not contiguous: the Python path
        else:
            got = adapter.all_reduce(x, "sum", out=x)  # the Python path (ops._all_reduce)
        if got.tobytes() != want(size, dtype).tobytes():
            fail(f"collective {i} (path {how}): {got[:5]} != {want(size, dtype)[:5]}")
        y = data(r, 9, ml_dtypes.bfloat16)
        got = adapter.all_sum(y) if (i + r) % 2 else adapter.all_reduce(y, "sum")  # fast / Python path
        if got.tobytes() != want(9, ml_dtypes.bfloat16).tobytes():
            fail(f"bfloat16 after collective {i}")
        z = data(r, 3, np.int32)
        got = adapter.all_max(z) if (i + r) % 2 else adapter.all_reduce(z, "max")
        if got.tobytes() != want(3, np.int32, np.maximum).tobytes():
            fail(f"max after collective {i}")
    # The fast path took its calls (and left the others): asked directly, as ops asks.
    x, b = data(r, 4, np.float32), data(r, 4, ml_dtypes.bfloat16)
    taken = [g.fast.all_reduce(x, x, 0), g.fast.all_reduce(b, None, 0)]
    left = [g.fast.all_reduce(x[::2], None, 0), g.fast.all_reduce(x.astype(">f4"), None, 0),
            g.fast.all_reduce(np.frombuffer(bytearray(17), np.float32, 4, 1), None, 0)]  # unaligned
    if any(t is NotImplemented for t in taken) or any(t is not NotImplemented for t in left):
        fail(f"the fast path took the wrong calls: {taken} {left}")
    sequences_agree()


def gil() -> None:
    counted = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counted[0] += 1
    x = np.ones(4, np.float32)
    if r == 0:
        thread = threading.Thread(target=count)
        thread.start()
        time.sleep(0.05)
        before = counted[0]
        started = time.monotonic()
        adapter.all_sum(x, out=x)  # rank 1 comes 0.4 s late
        waited = time.monotonic() - started
        during = counted[0] - before
        stop.set()
        thread.join()
        if waited < 0.3 or during < 10000:
            fail(f"another thread counted {during} while the fast path waited {waited:.3f} s")
    else:
        time.sleep(0.4)
        adapter.all_sum(x, out=x)
    if x.tolist() != [n] * 4:
        fail(f"gil: {x}")


def mismatch() -> None:
    texts = []
    for path in ("fast", "python"):
        sub = g.split(0)
        if sub.fast is None:
            fail("a split of the group has no fast path")
        x = np.ones(3 + r, np.float32)  # different sizes on the two ranks
        try:
            if path == "fast":
                adapter.all_sum(x, out=x, group=sub)
            else:
                adapter.all_reduce(x, "sum", out=x, group=sub)
        except MismatchError as exc:
            texts.append(f"{type(exc).__name__}: {exc}")
        else:
            fail(f"{path}: no MismatchError")
        try:
            adapter.all_sum(x, out=x, group=sub)
        except DistributedError as exc:
            texts.append(f"{type(exc).__name__}: {exc}")
        else:
            fail(f"{path}: the failed group ran another collective")
        sub.close()
    if texts[:2] != texts[2:] or "mismatch" not in texts[0]:
        fail("the fast path and the Python path word a mismatch apart:\n" + "\n".join(texts))


def dead() -> None:
    x = np.ones(8, np.float32)
    adapter.all_sum(x, out=x)
    if r == 2:
        os._exit(0)
    try:
        if r == 0:
            adapter.all_sum(x, out=x)  # fast
        else:
            adapter.all_reduce(x, "sum", out=x)  # the Python path
    except PeerError as exc:
        if failure_of(exc).culprit != 2 or "rank 2" not in str(exc):
            fail(f"the error does not name rank 2: {exc!r} (culprit {failure_of(exc).culprit})")
    else:
        fail("no PeerError after rank 2 exited")
    try:
        adapter.all_sum(x, out=x)
    except DistributedError as exc:
        if "unusable after an earlier error" not in str(exc):
            fail(f"refusal: {exc}")
    else:
        fail("the failed group ran another collective")


if sys.argv[1] == "mix":
    if state is not None:
        state.seq = 0xFFFFFFFF - 3  # the mix crosses the header's 32-bit wrap on both paths
    mix()
    gil()
    mismatch()
else:
    dead()
print(f"rank {r}: ok")
