"""The engine's fast path for all_gather, sum_scatter, broadcast and barrier (csrc/python/
shell_calls.c) beside the Python path, over shared memory (ring or JACCL, 2 or 3 ranks):

- mixed: for dtypes of every kind and sizes up to more than a chunk of the segment, the ranks
  take different paths for the same collective (the fast path: an exact C-contiguous array, a
  fresh result, out= another array or, for broadcast, out=x; the Python path: a strided view of
  the same values, or reduce_scatter(x, "sum"), or the backend's barrier), and every result is
  bit-identical to the one computed here; out= returns out itself;
- asked directly as ops asks: the fast path takes those calls and leaves to the Python path a
  strided or big-endian array, a list, an out= of another shape, dtype or kind, or overlapping
  x, a read-only out=, a root out of range, a first axis the group does not divide, a 0-d
  sum_scatter, a dtype the reduction does not take; the Python path then words its refusal;
- the ring's sequence number is the segment's on every rank; two ranks calling different
  collectives get the same MismatchError through the fast path as through the Python path."""

import ml_dtypes
import numpy as np
from fast_job import fail, g, n, r, sequences_agree, state, worded_alike

import adapter

DTYPES = [np.float32, np.int64, np.float16, ml_dtypes.bfloat16, np.bool_, np.complex64, np.uint8]


def data(q: int, shape: tuple, dtype) -> np.ndarray:
    base = (np.arange(int(np.prod(shape))).reshape(shape) * 7 + q * 3) % 11
    return (base % 2 == 0) if np.dtype(dtype) == np.bool_ else base.astype(dtype)


def strided(a: np.ndarray) -> np.ndarray:
    """The same values in a non-contiguous view: the Python path's input."""
    wide = np.zeros(a.shape + (2,), a.dtype)
    wide[..., 0] = a
    return wide[..., 0]


def summed(shape: tuple, dtype) -> np.ndarray:
    if np.dtype(dtype) == np.bool_:
        return np.logical_or.reduce([data(q, shape, dtype) for q in range(n)])
    wide = np.float32 if np.dtype(dtype) in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)) else dtype
    return np.sum([data(q, shape, wide) for q in range(n)], axis=0).astype(dtype)


def same(label: str, got: object, want: np.ndarray) -> None:
    if type(got) is not np.ndarray or got.dtype != want.dtype or got.shape != want.shape:
        fail(f"{label}: got {type(got).__name__} {getattr(got, 'dtype', '?')} {getattr(got, 'shape', '?')}, "
             f"want {want.dtype} {want.shape}")
    if got.tobytes() != want.tobytes():
        fail(f"{label}: {got.ravel()[:6]} != {want.ravel()[:6]}")


def mixed() -> None:
    for i in range(84):
        dtype = DTYPES[i % len(DTYPES)]
        rows = (1, 6, 1500, 30000)[i // len(DTYPES) % 4]  # 30000 x 3 x 8 bytes: beyond one chunk
        shape = (rows * n, 3)
        fast = (i + r) % 2 == 0
        mode = i // 2 % 2  # a fresh result, or out=
        label = f"collective {i} ({np.dtype(dtype)}{shape}, {'fast' if fast else 'Python'} path, mode {mode})"
        x = data(r, shape, dtype)
        want = np.concatenate([data(q, shape, dtype) for q in range(n)])
        out = np.empty_like(want) if mode else None
        got = adapter.all_gather(x if fast else strided(x), out=out)
        same("all_gather " + label, got, want)
        if out is not None and got is not out:
            fail(f"all_gather {label}: out= returned another array")
        block = shape[0] // n
        want = summed(shape, dtype)[r * block:(r + 1) * block]
        out = np.empty_like(want) if mode else None
        got = adapter.sum_scatter(x, out=out) if fast else adapter.reduce_scatter(x, "sum", out=out)
        same("sum_scatter " + label, got, want)
        root = i % n
        want = data(root, shape, dtype)
        if fast and mode:
            got = adapter.broadcast(x, root, out=x)  # in place
            if got is not x:
                fail(f"broadcast {label}: out=x returned another array")
        else:
            got = adapter.broadcast(x if fast else strided(x), root)
        same("broadcast " + label, got, want)
        if fast:
            adapter.barrier()
        else:
            g.backend.barrier()  # the backend's own: the Python path
    scalar = adapter.all_gather(np.float32(r + 1) * np.ones((), np.float32))
    same("all_gather of a 0-d array", scalar, np.arange(1, n + 1, dtype=np.float32))


def taken_and_left() -> None:
    x = data(r, (2 * n, 3), np.float32)
    rows = x.shape[0]
    taken = [("all_gather", g.fast.all_gather, (x, None)),
             ("all_gather out=", g.fast.all_gather, (x, np.empty((n * rows, 3), np.float32))),
             ("reduce_scatter", g.fast.reduce_scatter, (x, None, 0)),
             ("reduce_scatter out=", g.fast.reduce_scatter, (x, np.empty((rows // n, 3), np.float32), 0)),
             ("broadcast", g.fast.broadcast, (x, None, 0)), ("broadcast out=x", g.fast.broadcast, (x, x, n - 1)),
             ("broadcast out=", g.fast.broadcast, (x, np.empty_like(x), 0)), ("barrier", g.fast.barrier, ())]
    for label, call, args in taken:
        if call(*args) is NotImplemented:
            fail(f"the fast path left {label}")
    read_only = np.empty((n * rows, 3), np.float32)
    read_only.flags.writeable = False
    left = [("strided", g.fast.all_gather, (x[:, 0], None)),
            ("big-endian", g.fast.all_gather, (x.astype(">f4"), None)),
            ("a list", g.fast.all_gather, (x.tolist(), None)),
            ("out= of another shape", g.fast.all_gather, (x, np.empty((rows, 3), np.float32))),
            ("out= of another dtype", g.fast.all_gather, (x, np.empty((n * rows, 3), np.float64))),
            ("out= a list", g.fast.all_gather, (x, [0.0] * (n * rows * 3))),
            ("read-only out=", g.fast.all_gather, (x, read_only)),
            ("overlapping out=", g.fast.reduce_scatter, (x, x[:rows // n], 0)),
            ("a first axis the group does not divide", g.fast.reduce_scatter, (x[:rows - 1], None, 0)),
            ("0-d", g.fast.reduce_scatter, (np.ones((), np.float32), None, 0)),
            ("complex max", g.fast.reduce_scatter, (x.astype(np.complex64), None, 2)),
            ("root out of range", g.fast.broadcast, (x, None, n)), ("negative root", g.fast.broadcast, (x, None, -1)),
            ("read-only in place", g.fast.broadcast, (read_only, read_only, 0))]
    for label, call, args in left:
        if call(*args) is not NotImplemented:
            fail(f"the fast path took {label}")
    for label, call, words in [("overlapping out=", lambda: adapter.sum_scatter(x, out=x[:rows // n]), "overlaps"),
                               ("indivisible", lambda: adapter.sum_scatter(x[:rows - 1]), "divisible"),
                               ("root out of range", lambda: adapter.broadcast(x, n), "out of range"),
                               ("out= of another shape", lambda: adapter.all_gather(x, out=np.empty((1, 3))), "shape")]:
        try:
            call()
        except (ValueError, TypeError) as exc:
            if words not in str(exc):
                fail(f"{label}: unexpected message {exc}")
        else:
            fail(f"{label}: no error")


def sequence_and_mismatch() -> None:
    sequences_agree()

    def gather_or_broadcast(x: np.ndarray) -> object:  # rank 0 gathers, the others broadcast
        return lambda sub: adapter.all_gather(x, group=sub) if r == 0 else adapter.broadcast(x, 0, group=sub)
    worded_alike({"fast path": gather_or_broadcast(np.ones(4, np.float32)),
                  "Python path": gather_or_broadcast(strided(np.ones(4, np.float32)))})

if state is not None:
    state.seq = 0xFFFFFFFF - 40  # the mixed calls cross the header's 32-bit wrap on both paths
mixed()
taken_and_left()
sequence_and_mismatch()
print(f"rank {r}: ok")
