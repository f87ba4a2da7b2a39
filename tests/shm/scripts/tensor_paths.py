"""The engine's fast path for plain torch CPU tensors (csrc/python/tensors.c) beside the Python
path, 2 ranks over shared memory (ring or JACCL):

- every dtype the library takes, sum / max / min, a few shapes, a fresh result, in place and into
  another tensor: the ranks take different paths for the same collective (all_sum: the fast path;
  all_reduce(op): the Python path, through numpy views), and every result is bit-identical to
  the other path's and to the sum computed here, a plain contiguous CPU tensor of x's dtype and
  shape that does not require grad; out= returns out itself;
- asked directly as ops asks: the fast path takes plain tensors (a 0-d one, a fresh result of a
  tensor that requires grad) and leaves to the Python path a subclass (Parameter), a strided
  view, lazy conjugation and negation, sparse, meta and empty tensors, a tensor that requires
  grad in place, an out= of another dtype or shape, overlapping x, or of numpy; and the Python
  path gives those the right results;
- all_gather, sum_scatter and broadcast of tensors of several dtypes and sizes, a fresh result
  or out= (broadcast: out=x), mixed per rank with the Python path (a strided view of the same
  values, reduce_scatter(x, "sum")) as above; the fast path takes those calls, a 0-d all_gather
  and a fresh result of a tensor that requires grad, and leaves a Parameter, a strided view, a
  first axis the group does not divide, an out= of another shape or of numpy, and broadcast in
  place into a tensor that requires grad;
- the ring's sequence number is the segment's on every rank; a size mismatch through the fast
  path is worded as the numpy fast path words it."""

import numpy as np
import torch
from fast_job import fail, g, n, r, sequences_agree, worded_alike

import adapter
from adapter.arrays import as_numpy, numpy_dtype, numpy_to_torch
from adapter.backends.elements import BFLOAT16

DTYPES = [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
          torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128]
FAST = {"sum": adapter.all_sum, "max": adapter.all_max, "min": adapter.all_min}


def data(q: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return to_tensor(numpy_data(q, shape, numpy_dtype(dtype)))


def numpy_data(q: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
    base = (np.arange(int(np.prod(shape))).reshape(shape) * 5 + q * 3) % 7 + 1
    if dtype == np.bool_:
        return base % 2 == 0
    if dtype.kind == "c":
        return (base + 1j * q).astype(dtype)
    return base.astype(dtype)


def to_tensor(arr: np.ndarray) -> torch.Tensor:
    return numpy_to_torch(np.ascontiguousarray(arr))


def want(shape: tuple, dtype: torch.dtype, op: str) -> torch.Tensor:
    """The reduction computed here in numpy (float16 and bfloat16 in float32, rounded once)."""
    dt = numpy_dtype(dtype)
    parts = [numpy_data(q, shape, dt) for q in range(n)]
    if dt == np.bool_:
        return to_tensor(np.logical_and(*parts) if op == "min" else np.logical_or(*parts))
    wide = np.float32 if dt in (np.dtype(np.float16), BFLOAT16) else dt
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
    return to_tensor(ufunc(parts[0].astype(wide), parts[1].astype(wide)).astype(dt))


def raw(t: torch.Tensor) -> bytes:
    return bytes(as_numpy(t)[0].view(np.uint8)) if t.numel() else b""


def check(label: str, got: object, expected: torch.Tensor, like: torch.Tensor) -> None:
    if type(got) is not torch.Tensor or got.dtype != like.dtype or got.shape != like.shape:
        fail(f"{label}: got {type(got).__name__} {getattr(got, 'dtype', '?')} {getattr(got, 'shape', '?')}")
    if got.requires_grad or not got.is_contiguous() or raw(got) != raw(expected):
        fail(f"{label}: {got.ravel()[:6]} != {expected.ravel()[:6]} (requires_grad {got.requires_grad})")


def every_dtype_and_op() -> None:
    i = 0
    for shape in [(1,), (), (3, 5), (1000,)]:
        for dtype in DTYPES:
            for op in ("sum", "max", "min"):
                if op != "sum" and dtype.is_complex:
                    continue
                for mode in ("fresh", "in place", "into another"):
                    i += 1
                    x = data(r, shape, dtype)
                    out = {"fresh": None, "in place": x, "into another": torch.empty_like(x)}[mode]
                    fast = (i + r) % 2 == 0  # the two ranks take different paths
                    got = FAST[op](x, out=out) if fast else adapter.all_reduce(x, op, out=out)
                    label = f"{op} {dtype}{tuple(shape)} {mode} ({'fast' if fast else 'Python'} path)"
                    check(label, got, want(shape, dtype, op), x)
                    if out is not None and got is not out:
                        fail(f"{label}: out= returned another tensor")


def taken_and_left() -> None:
    x = data(r, (4,), torch.float32)
    grad = data(r, (4,), torch.float32).requires_grad_()
    taken = [("in place", x, x), ("fresh", x, None), ("into another", x, torch.empty(4)),
             ("0-d", torch.tensor(2.0), None), ("bfloat16", data(r, (3,), torch.bfloat16), None),
             ("uint16", data(r, (3,), torch.uint16), None), ("complex", data(r, (3,), torch.complex64), None),
             ("requires grad, fresh", grad, None)]
    for label, t, out in taken:
        got = g.fast.all_reduce(t, out, 0)
        if got is NotImplemented:
            fail(f"the fast path left a plain tensor: {label}")
        if label == "requires grad, fresh" and got.requires_grad:
            fail("a fresh result requires grad")
    wide = torch.zeros(8)
    c = data(r, (3,), torch.complex64)
    left = [("Parameter", torch.nn.Parameter(x.clone()), None), ("strided", wide[::2], None),
            ("conj view", c.conj(), None), ("neg view", torch._neg_view(c), None),
            ("sparse", x.to_sparse(), None), ("meta", torch.empty(4, device="meta"), None),
            ("empty", torch.empty(0), None), ("requires grad, in place", grad, grad),
            ("out= of another dtype", x, torch.empty(4, dtype=torch.float64)),
            ("out= of another shape", x, torch.empty(2, 2)), ("out= overlapping", wide[:4], wide[2:6]),
            ("out= numpy", x, np.empty(4, np.float32)), ("numpy x, tensor out=", x.numpy(), torch.empty(4))]
    for label, t, out in left:
        if g.fast.all_reduce(t, out, 0) is not NotImplemented:
            fail(f"the fast path took {label}")
    # what the Python path gives them
    for label, t, expected in [("Parameter", torch.nn.Parameter(data(r, (4,), torch.float32)),
                                want((4,), torch.float32, "sum")),
                               ("strided", data(r, (8,), torch.float32)[::2],
                                want((8,), torch.float32, "sum")[::2]),
                               ("conj view", c.conj(), want((3,), torch.complex64, "sum").conj())]:
        check(f"{label} on the Python path", adapter.all_sum(t), expected.resolve_conj(), expected)


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous view: the Python path's input."""
    wide = torch.zeros(tuple(t.shape) + (2,), dtype=t.dtype)
    wide[..., 0] = t
    return wide[..., 0]


def other_collectives() -> None:
    i = 0
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.float16, torch.bool, torch.uint16):
        for rows in (1, 5, 30000):  # 30000 x 3 x 8 bytes: beyond one chunk of the segment
            i += 1
            shape = (rows * n, 3)
            x = data(r, shape, dtype)
            fast, mode = (i + r) % 2 == 0, i // 2 % 2  # the ranks take different paths; fresh or out=
            label = f"{dtype}{shape} ({'fast' if fast else 'Python'} path, mode {mode})"
            gathered = torch.cat([data(q, shape, dtype) for q in range(n)])
            out = torch.empty_like(gathered) if mode else None
            check("all_gather " + label, adapter.all_gather(x if fast else strided(x), out=out), gathered, gathered)
            block = want(shape, dtype, "sum")[r * rows:(r + 1) * rows]
            out = torch.empty_like(block) if mode else None
            got = adapter.sum_scatter(x, out=out) if fast else adapter.reduce_scatter(x, "sum", out=out)
            check("sum_scatter " + label, got, block, block)
            root = i % n
            if fast and mode:
                got = adapter.broadcast(x, root, out=x)
                if got is not x:
                    fail(f"broadcast {label}: out=x returned another tensor")
            else:
                got = adapter.broadcast(x if fast else strided(x), root)
            check("broadcast " + label, got, data(root, shape, dtype), x)
    scalar = torch.tensor(float(r + 1))
    check("all_gather of a 0-d tensor", adapter.all_gather(scalar), torch.arange(1.0, n + 1), torch.arange(1.0, n + 1))
    x = data(r, (2 * n, 3), torch.float32)
    grad = x.clone().requires_grad_()
    taken = [("all_gather", g.fast.all_gather, (x, None)), ("all_gather of 0-d", g.fast.all_gather, (scalar, None)),
             ("all_gather out=", g.fast.all_gather, (x, torch.empty(2 * n * n, 3))),
             ("all_gather, requires grad", g.fast.all_gather, (grad, None)),
             ("reduce_scatter", g.fast.reduce_scatter, (x, None, 0)),
             ("reduce_scatter out=", g.fast.reduce_scatter, (x, torch.empty(2, 3), 0)),
             ("broadcast", g.fast.broadcast, (x, None, 0)), ("broadcast out=x", g.fast.broadcast, (x, x, n - 1)),
             ("broadcast out=", g.fast.broadcast, (x, torch.empty(2 * n, 3), 0))]
    for label, call, args in taken:
        got = call(*args)
        if got is NotImplemented or got.requires_grad:
            fail(f"the fast path left {label}, or its result requires grad")
    left = [("Parameter", g.fast.all_gather, (torch.nn.Parameter(x.clone()), None)),
            ("strided", g.fast.all_gather, (strided(x), None)),
            ("indivisible", g.fast.reduce_scatter, (x[:2 * n - 1], None, 0)),
            ("out= of another shape", g.fast.all_gather, (x, torch.empty(2 * n, 3))),
            ("out= numpy", g.fast.reduce_scatter, (x, np.empty((2, 3), np.float32), 0)),
            ("requires grad, in place", g.fast.broadcast, (grad, grad, 0))]
    for label, call, args in left:
        if call(*args) is not NotImplemented:
            fail(f"the fast path took {label}")


def sequence_and_mismatch() -> None:
    sequences_agree()
    worded_alike({"tensor": lambda sub: adapter.all_sum(torch.ones(3 + r), group=sub),
                  "array": lambda sub: adapter.all_sum(np.ones(3 + r, np.float32), group=sub)})

every_dtype_and_op()
taken_and_left()
other_collectives()
sequence_and_mismatch()
print(f"rank {r}: ok")
