"""Collectives of a ring group that spans hosts, when some host has several of its ranks.

The ranks of each such host share a segment (local/shm.py), and the first rank of every host
(its leader) is also a member of the leaders' ring, one rank per host, formed by a split of the
group when the group forms. A collective then runs in three stages:

  1. on each host, over shared memory: its ranks combine their inputs (all_reduce: the host's
     result on every rank of it; all_gather: the host's blocks);
  2. between hosts, over the leaders' ring (sockets): the leaders combine the hosts' results;
  3. on each host, over shared memory: the leader hands the result to the host's ranks.

So each host sends its data between hosts once, whatever its number of ranks, and a host's ranks
exchange theirs in memory. Every rank gets the same bits (the leaders' result, handed on), but a
reduction runs host by host, not in rank order. reduce_scatter: the host's ranks all_reduce the
whole buffer in memory, the leaders reduce-scatter it laid out host by host (each host's
members' blocks together, padded to the widest host), and each leader hands its host's blocks
on. send/recv and split stay on the group's ring sockets.

A leaders' collective carries the group's operation and a broadcast's root in its header
(stage_tag): broadcasts from two roots of one host, which the leaders' ring alone cannot tell
apart, raise a mismatch there instead of handing on the wrong data.

Failure: a rank that fails in any stage marks its host's segment broken (the host's ranks fail at
once, naming the rank it blames) and, if it is a leader, tells its neighbours in the leaders' ring
whom it blames (by rank of the group, origin.notify_outer) and closes its links there, so every other
host fails too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from ...errors import DistributedError, PeerError
from ..base import ReduceOp
from ..local import algorithms as shm_algorithms
from ..local.shm import Placement, SharedGroup
from . import origin
from .header import OP_ALL_GATHER, OP_ALL_REDUCE, OP_BARRIER, OP_BROADCAST, OP_REDUCE_SCATTER, stage_tag
from .state import RingState

if TYPE_CHECKING:
    from .backend import RingBackend

class Hierarchy:
    """Where this rank is (its host's members, its segment) and the leaders' ring, if a leader."""

    def __init__(self, rank: int, placement: Placement, leaders: "RingBackend | None") -> None:
        self.rank = rank
        self.hosts = placement.hosts
        self.host_of = {q: h for h, members in enumerate(self.hosts) for q in members}
        self.host = self.host_of[rank]
        self.members = self.hosts[self.host]
        self.local: SharedGroup | None = placement.group  # None: the only rank on its host
        self.leaders = leaders                            # None: not its host's first rank
        self.leader_ranks = [members[0] for members in self.hosts]
        self.widest = max(len(members) for members in self.hosts)
        self._scratch: dict = {}

    def buffer(self, tag: str, dtype: np.dtype, count: int) -> np.ndarray:
        key = (tag, np.dtype(dtype))
        buf = self._scratch.get(key)
        if buf is None or buf.size < count:
            buf = self._scratch[key] = np.zeros(max(count, 1), dtype)
        return buf[:count]

    def between_hosts(self, op_code: int, detail: int, call: Callable[["RingBackend"], None]) -> None:
        """Run call(leaders' ring) as a stage of the group's operation op_code (detail: its root
        for a broadcast); errors are reworded by ranks of the group."""
        leaders = self.leaders
        assert leaders is not None
        leaders.state.stage = stage_tag(op_code, detail)
        try:
            call(leaders)
        except DistributedError as exc:
            raise self._reworded(exc) from None
        finally:
            leaders.state.stage = 0

    def _reworded(self, exc: DistributedError) -> DistributedError:
        outer = getattr(exc, "outer_culprit", None)
        culprit = getattr(exc, "culprit", -1)
        if outer is not None:
            culprit = outer
        elif 0 <= culprit < len(self.leader_ranks):
            culprit = self.leader_ranks[culprit]
        where = (f"the ring of each host's first rank (whose ranks {', '.join(map(str, range(len(self.leader_ranks))))} "
                 f"are ranks {', '.join(map(str, self.leader_ranks))} of this group)")
        if isinstance(exc, PeerError) and culprit >= 0:
            new = PeerError(f"rank {self.rank}: rank {culprit} died or failed, as seen between hosts in {where}: {exc}")
        else:
            new = type(exc)(f"rank {self.rank}: between hosts, in {where}: {exc}")
        new.culprit = culprit
        new.from_leaders = True
        return new

    def fail(self, exc: BaseException) -> None:
        """This rank's collective failed: tell its host's ranks and the other leaders now."""
        culprit = getattr(exc, "culprit", -1)
        if self.local is not None:
            self.local.mark_broken(culprit)
        leaders = self.leaders
        if leaders is None:
            return
        if not getattr(exc, "from_leaders", False):  # the leaders' ring told its peers already
            origin.notify_outer(leaders.state, culprit)
        leaders.break_links(f"rank {self.rank}: a collective of its group failed")

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
            self.local = None
        if self.leaders is not None:
            self.leaders.close()
            self.leaders = None


def form(backend: "RingBackend", placement: Placement) -> Hierarchy:
    """Split the group into the leaders' ring (the collective every rank calls once)."""
    rank = backend.rank()
    leader = any(members[0] == rank for members in placement.hosts)
    # The other ranks each get a group of their own (no connections), closed at once.
    sub = backend.split(0 if leader else 1 + rank, rank)
    if not leader:
        sub.close()
    return Hierarchy(rank, placement, sub if leader else None)


def run(state: RingState, body: Callable, *args) -> None:
    """Run one collective in stages, body(hierarchy, *args), under the group's deadline."""
    h = state.hier
    if h.local is not None:
        h.local.deadline = state.deadline
        h.local.what = state.what
    if h.leaders is not None:
        h.leaders.timeout = state.timeout
    try:
        body(h, *args)
    except BaseException as exc:
        h.fail(exc)
        raise


def all_reduce(h: Hierarchy, header: bytes, src: np.ndarray, dst: np.ndarray, op: ReduceOp,
               small_bytes: int) -> None:
    if h.local is not None:
        shm_algorithms.all_reduce(h.local, header, src, dst, op, small_bytes)
    else:
        dst[...] = src
    if h.leaders is not None:
        h.between_hosts(OP_ALL_REDUCE, 0, lambda ring: ring.all_reduce(dst, dst, op))
    if h.local is not None:
        shm_algorithms.broadcast(h.local, None, dst, 0)


def reduce_scatter(h: Hierarchy, header: bytes, src: np.ndarray, dst: np.ndarray, op: ReduceOp,
                   small_bytes: int) -> None:
    m, k = dst.size, len(h.members)
    full = h.buffer("reduce_scatter full", src.dtype, src.size)
    if h.local is not None:
        shm_algorithms.all_reduce(h.local, header, src, full, op, small_bytes)
    else:
        full[...] = src
    # The leaders reduce-scatter blocks laid out host by host (each host `widest` blocks, the
    # padding zeros), so each leader ends with its host's members' blocks.
    ours = h.buffer("reduce_scatter host", src.dtype, h.widest * m)
    if h.leaders is not None:
        laid_out = h.buffer("reduce_scatter by host", src.dtype, len(h.hosts) * h.widest * m)
        for host, members in enumerate(h.hosts):
            at = host * h.widest * m
            for j, q in enumerate(members):
                laid_out[at + j * m:at + (j + 1) * m] = full[q * m:(q + 1) * m]
            laid_out[at + len(members) * m:at + h.widest * m] = 0
        h.between_hosts(OP_REDUCE_SCATTER, 0, lambda ring: ring.reduce_scatter(laid_out, ours, op))
    if h.local is not None:
        shm_algorithms.broadcast(h.local, None, ours[:k * m], 0)
    j = h.members.index(h.rank)
    dst[...] = ours[j * m:(j + 1) * m]


def all_gather(h: Hierarchy, header: bytes, src: np.ndarray, dst: np.ndarray) -> None:
    m, k = src.size, len(h.members)
    # Every host sends `widest` blocks (the leaders' all_gather needs one size); the padding is
    # zeros, never another call's data.
    host_blocks = h.buffer("all_gather host", src.dtype, h.widest * m)
    host_blocks[k * m:] = 0
    if h.local is not None:
        shm_algorithms.all_gather(h.local, header, src, host_blocks[:k * m])
    else:
        host_blocks[:m] = src
    if h.leaders is not None:
        table = h.buffer("all_gather table", src.dtype, len(h.hosts) * h.widest * m)
        h.between_hosts(OP_ALL_GATHER, 0, lambda ring: ring.all_gather(host_blocks, table))
        for host, members in enumerate(h.hosts):
            for j, q in enumerate(members):
                at = (host * h.widest + j) * m
                dst[q * m:(q + 1) * m] = table[at:at + m]
    if h.local is not None:
        shm_algorithms.broadcast(h.local, None, dst, 0)


def broadcast(h: Hierarchy, header: bytes, buf: np.ndarray, root: int) -> None:
    root_host = h.host_of[root]
    on_root_host = h.host == root_host
    if h.local is not None and on_root_host:
        shm_algorithms.broadcast(h.local, header, buf, h.members.index(root))
    if h.leaders is not None:
        h.between_hosts(OP_BROADCAST, root, lambda ring: ring.broadcast(buf, root_host))
    if h.local is not None and not on_root_host:
        shm_algorithms.broadcast(h.local, header, buf, 0)


def barrier(h: Hierarchy, header: bytes) -> None:
    if h.local is not None:
        shm_algorithms.barrier(h.local, header)
    if h.leaders is not None:
        h.between_hosts(OP_BARRIER, 0, lambda ring: ring.barrier())
    if h.local is not None:
        h.local.exchange()
