"""Collectives for a group whose ranks share memory (local.shm.SharedGroup).

Each is a sequence of steps (write my buffer, exchange, read the peers' buffers); the first step
carries the collective's header so that a mismatch raises on every rank before any data is used.

all_reduce, large: every rank copies the slices of its input that the others reduce into its
buffer, then reduces its own 1/n slice straight out of the peers' buffers (its own input read in
place) and publishes the result, and finally everyone copies the reduced slices out: one copy in,
one read of every input, one write, one copy out. A buffer holds rank q's reduced slice of chunk
k at slot q and the inputs of chunk k+1 at the other slots, so chunk k's result and chunk k+1's
inputs travel in one step: the buffers stay bounded (chunk_bytes per rank and parity) and a
message of c chunks costs c + 1 steps. Reductions run in rank order, so every rank gets
bit-identical results.
"""
from __future__ import annotations

import numpy as np

from ..base import ReduceOp
from ..elements import BFLOAT16, quiet_call, quiet_ufunc, reduce_many, split_evenly
from .shm import SharedGroup


def all_reduce(g: SharedGroup, header: bytes, src: np.ndarray, dst: np.ndarray, op: ReduceOp,
               small_bytes: int) -> None:
    n, r, dt, count = g.size, g.rank, src.dtype, src.size
    cap = g.chunk_bytes // src.itemsize
    if src.nbytes <= small_bytes and count <= cap:
        small_all_reduce(g, header, src, dst, op)
        return
    w = cap // n  # elements per slot
    chunks = [(lo, split_evenly(min(lo + w * n, count) - lo, n)) for lo in range(0, count, w * n)]
    pending = None  # (lo, bounds, parity): the chunk whose inputs were exchanged in the last step
    first: bytes | None = header
    for k in range(len(chunks) + 1):
        mine = g.typed(r, g.step & 1, dt)
        if pending is not None:
            lo, bounds, pp = pending
            a, b = bounds[r]
            parts = [src[lo + a:lo + b] if q == r else g.typed(q, pp, dt)[r * w:r * w + b - a] for q in range(n)]
            reduce_many(mine[r * w:r * w + b - a], parts, op)
        if k < len(chunks):
            lo, bounds = chunks[k]
            for q in g.peers:
                a, b = bounds[q]
                mine[q * w:q * w + b - a] = src[lo + a:lo + b]
        p = g.exchange(first)
        first = None
        if pending is not None:
            lo, bounds, _ = pending
            for q in range(n):
                a, b = bounds[q]
                dst[lo + a:lo + b] = g.typed(q, p, dt)[q * w:q * w + b - a]
        pending = (chunks[k][0], chunks[k][1], p) if k < len(chunks) else None


def small_all_reduce(g: SharedGroup, header: bytes, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
    """One step: everyone reduces the whole (small, at most one chunk) message itself, in rank
    order. The views and the reduction are worked out once per (dtype, op, count): at a few
    bytes, their set-up costs more than the copy and the reduction do."""
    plan = g.plans.get((src.dtype, op, src.size))
    if plan is None:
        plan = _small_plan(g, src.dtype, op, src.size)
    mine, reduce = plan[g.step & 1]
    mine[...] = src
    g.exchange(header)
    reduce(dst)


_PLANS = 64  # distinct (dtype, op, count) kept per group; a workload with more starts over


def _small_plan(g: SharedGroup, dt: np.dtype, op: ReduceOp, count: int) -> tuple:
    """Per parity: this rank's buffer (count elements), and a function reducing every rank's
    buffer into a dst of count elements (what reduce_rows does, decided in advance)."""
    if len(g.plans) >= _PLANS:
        g.plans.clear()
    plan = tuple((g.typed(g.rank, p, dt)[:count], _row_reduction(g.stacked(p, dt)[:, :count], op))
                 for p in (0, 1))
    g.plans[(dt, op, count)] = plan
    return plan


def _row_reduction(rows: np.ndarray, op: ReduceOp):
    """reduce_rows(dst, rows, op) with its choices made now, for these rows."""
    dt = rows.dtype
    if dt == np.bool_ or dt in _WIDEN:
        return lambda dst: reduce_rows(dst, rows, op)
    ufunc = _UFUNCS[op]
    if len(rows) == 2 or rows.shape[1] >= _CHAIN_ELEMENTS:
        first, second, rest = rows[0], rows[1], list(rows[2:])
        if not rest:
            if dt.kind in "fc":
                return lambda dst: quiet_ufunc(ufunc, first, second, dst)
            return lambda dst: ufunc(first, second, out=dst)
        if dt.kind in "fc":
            return lambda dst: quiet_call(_chain, ufunc, first, second, rest, dst)
        return lambda dst: _chain(ufunc, first, second, rest, dst)
    reduce = ufunc.reduce
    if dt.kind in "fc":
        return lambda dst: quiet_call(reduce, rows, 0, None, dst)
    return lambda dst: reduce(rows, axis=0, out=dst)


def _chain(ufunc: np.ufunc, first: np.ndarray, second: np.ndarray, rest: list, dst: np.ndarray) -> None:
    ufunc(first, second, out=dst)
    for row in rest:
        ufunc(dst, row, out=dst)


_UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MAX: np.maximum,
           ReduceOp.MIN: np.minimum, ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or,
           ReduceOp.BXOR: np.bitwise_xor}
_WIDEN = (np.dtype(np.float16), BFLOAT16)


def reduce_rows(dst: np.ndarray, rows: np.ndarray, op: ReduceOp) -> None:
    """dst = op over the rows of a (ranks, count) array, row by row in rank order: one ufunc call
    instead of one per rank. Same results as elements.reduce_many (bool ops spelt out, float16
    and bfloat16 accumulated in float32 and rounded once)."""
    dt = dst.dtype
    if dt == np.bool_ or dt in _WIDEN:
        reduce_many(dst, list(rows), op)
    elif dt.kind in "fc":
        with np.errstate(over="ignore", invalid="ignore"):  # inf and nan are the IEEE answers
            _reduce_in_rank_order(_UFUNCS[op], rows, dst)
    else:
        _reduce_in_rank_order(_UFUNCS[op], rows, dst)


# From this many elements up, one binary ufunc call per row beats ufunc.reduce over axis 0 of
# a (ranks, count) array (numpy walks that axis with a strided inner loop); below it the extra
# Python calls cost more than they save.
_CHAIN_ELEMENTS = 4096


def _reduce_in_rank_order(ufunc: np.ufunc, rows: np.ndarray, dst: np.ndarray) -> None:
    """dst = ((rows[0] op rows[1]) op rows[2]) ...: the order ufunc.reduce(axis=0) uses too."""
    if len(rows) == 2 or dst.size >= _CHAIN_ELEMENTS:
        ufunc(rows[0], rows[1], out=dst)
        for row in rows[2:]:
            ufunc(dst, row, out=dst)
    else:
        ufunc.reduce(rows, axis=0, out=dst)


def reduce_scatter(g: SharedGroup, header: bytes, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
    n, r, dt, m = g.size, g.rank, src.dtype, dst.size
    w = g.chunk_bytes // src.itemsize // n
    first: bytes | None = header
    for lo in range(0, max(m, 1), w):
        length = min(w, m - lo)
        mine = g.typed(r, g.step & 1, dt)
        for q in g.peers:
            mine[q * w:q * w + length] = src[q * m + lo:q * m + lo + length]
        p = g.exchange(first)
        first = None
        parts = [src[r * m + lo:r * m + lo + length] if q == r else g.typed(q, p, dt)[r * w:r * w + length]
                 for q in range(n)]
        reduce_many(dst[lo:lo + length], parts, op)


def all_gather(g: SharedGroup, header: bytes, src: np.ndarray, dst: np.ndarray) -> None:
    n, r, dt, m = g.size, g.rank, src.dtype, src.size
    cap = g.chunk_bytes // src.itemsize
    first: bytes | None = header
    for lo in range(0, max(m, 1), cap):
        hi = min(lo + cap, m)
        g.typed(r, g.step & 1, dt)[:hi - lo] = src[lo:hi]
        p = g.exchange(first)
        first = None
        for q in range(n):
            dst[q * m + lo:q * m + hi] = src[lo:hi] if q == r else g.typed(q, p, dt)[:hi - lo]


def broadcast(g: SharedGroup, header: bytes, buf: np.ndarray, root: int) -> None:
    cap = g.chunk_bytes // buf.itemsize
    first: bytes | None = header
    for lo in range(0, max(buf.size, 1), cap):
        hi = min(lo + cap, buf.size)
        if g.rank == root:
            g.typed(root, g.step & 1, buf.dtype)[:hi - lo] = buf[lo:hi]
        p = g.exchange(first)
        first = None
        if g.rank != root:
            buf[lo:hi] = g.typed(root, p, buf.dtype)[:hi - lo]


def barrier(g: SharedGroup, header: bytes) -> None:
    g.exchange(header)
