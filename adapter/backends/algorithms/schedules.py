"""Log-latency collective schedules over a PeerExchange (peers.py).

Group sizes that are not a power of two are folded (as MPICH does): with p the largest power of
two not above n and rem = n - p, each even rank r < 2 rem hands its data to r + 1 first and
takes the result back last; the other p ranks run the power-of-two schedule as virtual ranks
0..p-1. Virtual rank v stands for the real ranks [v + min(v, rem), v + 1 + min(v + 1, rem)), so
the blocks of consecutive virtual ranks stay contiguous and no data is packed. Folding costs two
steps; it is never skipped in favour of another schedule.

Identical bits on every rank, from run to run: wherever two partial results meet, the one that
covers the lower ranks is the left operand (op(lower, higher)), on both sides of the pair. Each
rank of a pair therefore computes the same value, and the reduction tree depends only on the
group size, never on which rank runs it (docs/algorithms.md).
"""
from __future__ import annotations

import numpy as np

from ..base import ReduceOp
from ..elements import block_bounds, byte_view, reduce_into
from .peers import PeerExchange

_EMPTY = memoryview(bytearray(0))  # writable: a receive target too


class Fold:
    """The power-of-two core of a group of n ranks, as seen by one rank."""

    __slots__ = ("n", "rank", "p", "rem", "virtual", "partner")

    def __init__(self, n: int, rank: int) -> None:
        self.n, self.rank = n, rank
        self.p = 1 << (n.bit_length() - 1)
        self.rem = n - self.p
        # virtual: this rank's virtual rank, or -1 when it is folded out; partner: the rank that
        # folds into this one (or that this one folds into), -1 without folding.
        if rank < 2 * self.rem:
            self.virtual = -1 if rank % 2 == 0 else rank // 2
            self.partner = rank + 1 if rank % 2 == 0 else rank - 1
        else:
            self.virtual, self.partner = rank - self.rem, -1

    @property
    def steps(self) -> int:
        """Steps the fold adds before the core (0 or 1): the core's first step is numbered this."""
        return 1 if self.rem else 0

    def real(self, v: int) -> int:
        """The rank that runs virtual rank v."""
        return 2 * v + 1 if v < self.rem else v + self.rem

    def first_rank(self, v: int) -> int:
        """The lowest real rank virtual rank v stands for (first_rank(p) == n)."""
        return v + min(v, self.rem)


def _reduce_pair(mine: np.ndarray, theirs: np.ndarray, mine_lower: bool, op: ReduceOp) -> None:
    """mine = op(lower, higher): the same operands in the same order on both ranks of the pair."""
    if mine_lower:
        reduce_into(mine, mine, theirs, op)
    else:
        reduce_into(mine, theirs, mine, op)


def _fold_in(x: PeerExchange, f: Fold, data: np.ndarray, scratch: np.ndarray, op: ReduceOp | None) -> None:
    """Step 0: a folded-out rank sends data; its partner reduces it in (op) as the lower operand.
    Without op (all_gather) the caller says where the partner's bytes land (scratch)."""
    if f.virtual < 0:
        x.sendrecv(0, {f.partner: byte_view(data)}, {})
        return
    x.sendrecv(0, {}, {f.partner: byte_view(scratch)})
    if op is not None:
        reduce_into(data, scratch, data, op)  # the partner is the lower rank


def _fold_out(x: PeerExchange, f: Fold, step: int, result: memoryview) -> None:
    """The last step: the partner hands the folded-out rank its result."""
    if f.virtual < 0:
        x.sendrecv(step, {}, {f.partner: result})
    else:
        x.sendrecv(step, {f.partner: result}, {})


def core_steps(n: int) -> int:
    return (1 << (n.bit_length() - 1)).bit_length() - 1


def all_reduce_doubling(x: PeerExchange, src: np.ndarray, dst: np.ndarray, op: ReduceOp,
                        scratch: np.ndarray) -> None:
    """Recursive doubling: log2(p) pair exchanges of the whole message (+ 2 fold steps).
    scratch holds src.size elements."""
    f = Fold(x.size, x.rank)
    if dst is not src:
        np.copyto(dst, src)
    if f.partner >= 0:
        _fold_in(x, f, dst, scratch, op)
        if f.virtual < 0:
            _fold_out(x, f, 1 + core_steps(x.size), byte_view(dst))
            return
    step, v, mine, theirs = f.steps, f.virtual, byte_view(dst), byte_view(scratch)
    d = 1
    while d < f.p:
        peer = f.real(v ^ d)
        x.sendrecv(step, {peer: mine}, {peer: theirs})
        _reduce_pair(dst, scratch, v < v ^ d, op)
        d <<= 1
        step += 1
    if f.partner >= 0:
        _fold_out(x, f, step, mine)


def _halving(x: PeerExchange, f: Fold, step: int, work: np.ndarray, scratch: np.ndarray, bounds: list[int],
             op: ReduceOp) -> int:
    """Recursive halving over the virtual ranks: afterwards work[bounds[v]:bounds[v + 1]] holds
    virtual rank v's block reduced over the whole group. Returns the next step's number."""
    v, lo, hi = f.virtual, 0, f.p
    d = f.p >> 1
    while d:
        mid = lo + d
        lower = v < mid
        keep = (lo, mid) if lower else (mid, hi)
        give = (mid, hi) if lower else (lo, mid)
        part = work[bounds[keep[0]]:bounds[keep[1]]]
        incoming = scratch[:part.size]
        peer = f.real(v ^ d)
        x.sendrecv(step, {peer: byte_view(work[bounds[give[0]]:bounds[give[1]]])}, {peer: byte_view(incoming)})
        _reduce_pair(part, incoming, lower, op)
        lo, hi = keep
        d >>= 1
        step += 1
    return step


def _doubling_gather(x: PeerExchange, f: Fold, step: int, out: np.ndarray, bounds: list[int]) -> int:
    """Recursive doubling all-gather over the virtual ranks: out[bounds[v]:bounds[v + 1]] is
    virtual rank v's, and afterwards every block is filled. Returns the next step's number."""
    v = f.virtual
    d = 1
    while d < f.p:
        mine, theirs = v & ~(d - 1), (v ^ d) & ~(d - 1)
        peer = f.real(v ^ d)
        x.sendrecv(step, {peer: byte_view(out[bounds[mine]:bounds[mine + d]])},
                   {peer: byte_view(out[bounds[theirs]:bounds[theirs + d]])})
        d <<= 1
        step += 1
    return step


def all_reduce_halving(x: PeerExchange, src: np.ndarray, dst: np.ndarray, op: ReduceOp,
                       scratch: np.ndarray) -> None:
    """Rabenseifner: reduce-scatter by recursive halving, then all-gather by recursive doubling;
    2 log2(p) steps (+ 2 fold steps), each rank sending about 2 x the message in all.
    scratch holds src.size elements."""
    f = Fold(x.size, x.rank)
    if dst is not src:
        np.copyto(dst, src)
    if f.partner >= 0:
        _fold_in(x, f, dst, scratch, op)
        if f.virtual < 0:
            _fold_out(x, f, 1 + 2 * core_steps(x.size), byte_view(dst))
            return
    bounds = block_bounds(dst.size, f.p)
    step = _halving(x, f, f.steps, dst, scratch, bounds, op)
    step = _doubling_gather(x, f, step, dst, bounds)
    if f.partner >= 0:
        _fold_out(x, f, step, byte_view(dst))


def reduce_scatter_halving(x: PeerExchange, src: np.ndarray, dst: np.ndarray, op: ReduceOp,
                           work: np.ndarray, scratch: np.ndarray) -> None:
    """Recursive halving reduce-scatter: dst (m elements) = rank's block of the reduction of src
    (n x m). work and scratch hold src.size elements each."""
    n, r, m = x.size, x.rank, dst.size
    f = Fold(n, r)
    if f.virtual < 0:
        x.sendrecv(0, {f.partner: byte_view(src)}, {})
        x.sendrecv(1 + core_steps(n), {}, {f.partner: byte_view(dst)})
        return
    np.copyto(work, src)
    if f.partner >= 0:
        _fold_in(x, f, work, scratch, op)
    bounds = [f.first_rank(v) * m for v in range(f.p + 1)]
    step = _halving(x, f, f.steps, work, scratch, bounds, op)
    if f.partner >= 0:
        x.sendrecv(step, {f.partner: byte_view(work[f.partner * m:(f.partner + 1) * m])}, {})
    np.copyto(dst, work[r * m:(r + 1) * m])


def all_gather_doubling(x: PeerExchange, src: np.ndarray, dst: np.ndarray) -> None:
    """Recursive doubling all-gather: log2(p) pair exchanges of growing contiguous regions
    (+ 2 fold steps). dst holds n x src.size elements."""
    n, r, m = x.size, x.rank, src.size
    f = Fold(n, r)
    dst[r * m:(r + 1) * m] = src
    if f.partner >= 0:
        lower = f.partner * m
        _fold_in(x, f, src, dst[lower:lower + m], None)
        if f.virtual < 0:
            _fold_out(x, f, 1 + core_steps(n), byte_view(dst))
            return
    bounds = [f.first_rank(v) * m for v in range(f.p + 1)]
    step = _doubling_gather(x, f, f.steps, dst, bounds)
    if f.partner >= 0:
        _fold_out(x, f, step, byte_view(dst))


def broadcast_tree(x: PeerExchange, buf: np.ndarray, root: int) -> None:
    """Binomial tree: ceil(log2 n) rounds; a rank receives once from its parent (the rank whose
    relative index lacks this one's lowest set bit), then sends to its children, the largest
    subtree first. A message is tagged with the bit that separates parent and child."""
    n, r = x.size, x.rank
    rel = (r - root) % n
    data = byte_view(buf)
    mask = 1
    while mask < n:
        if rel & mask:
            x.sendrecv(mask.bit_length() - 1, {}, {(r - mask) % n: data})
            break
        mask <<= 1
    mask >>= 1
    while mask:
        if rel + mask < n:
            x.sendrecv(mask.bit_length() - 1, {(r + mask) % n: data}, {})
        mask >>= 1


def barrier_dissemination(x: PeerExchange) -> None:
    """Dissemination: in round k every rank signals rank + 2^k and waits for rank - 2^k;
    after ceil(log2 n) rounds every rank has heard, indirectly, from every other."""
    n, r = x.size, x.rank
    k, s = 0, 1
    while s < n:
        x.sendrecv(k, {(r + s) % n: _EMPTY}, {(r - s) % n: _EMPTY})
        k += 1
        s <<= 1


def pair_partners(n: int, rank: int) -> set[int]:
    """The ranks this one exchanges with in the pair schedules (rd, rh, halving, doubling): a
    failure tells them first, since they are the ones that may wait for it."""
    f = Fold(n, rank)
    found = {f.partner} if f.partner >= 0 else set()
    if f.virtual >= 0:
        d = 1
        while d < f.p:
            found.add(f.real(f.virtual ^ d))
            d <<= 1
    return found


def tree_partners(n: int, rank: int, root: int) -> set[int]:
    """The binomial tree's parent and children of rank."""
    rel, found, mask = (rank - root) % n, set(), 1
    while mask < n:
        if rel & mask:
            found.add((rank - mask) % n)
            break
        if rel + mask < n:
            found.add((rank + mask) % n)
        mask <<= 1
    return found


def dissemination_partners(n: int, rank: int) -> set[int]:
    found, s = set(), 1
    while s < n:
        found |= {(rank + s) % n, (rank - s) % n}
        s <<= 1
    return found - {rank}
