"""Collectives of a group that spans hosts, when some host has several of its ranks: written
once for every backend (the ring, ring/shared.py; JACCL, jaccl/local.py).

The ranks of each such host share a segment (shm.py), and the first rank of every host (its
leader) is also a member of the leaders' group, one rank per host, which the backend forms with
its own split when the group forms (a ring of sockets for the ring; a mesh, TCP or RDMA, for
JACCL). A collective then runs in three stages:

  1. on each host, over shared memory: its ranks combine their inputs (all_reduce: the host's
     result on every rank of it; all_gather: the host's blocks);
  2. between hosts, over the leaders' group: the leaders combine the hosts' results;
  3. on each host, over shared memory: the leader hands the result to the host's ranks.

So each host sends its data between hosts once, whatever its number of ranks, and a host's ranks
exchange theirs in memory. Every rank gets the same bits (the leaders' result, handed on), but a
reduction runs host by host, not in rank order. reduce_scatter: the host's ranks all_reduce the
whole buffer in memory, the leaders reduce-scatter it laid out host by host (each host's
members' blocks together, padded to the widest host), and each leader hands its host's blocks
on. send/recv and split stay on the group's own links.

What is the backend's own comes in as the leaders' group (Leaders): a leaders' collective
carries the group's operation and a broadcast's root in its headers (set_stage, in the
backend's header layout), so broadcasts from two roots of one host, which the leaders alone
cannot tell apart, raise a mismatch there instead of handing on the wrong data; and a leader
that gives up tells the other leaders whom it blames, by rank of the whole group
(notify_outer), in the backend's notices.

Failure: a rank that fails in any stage marks its host's segment broken (the host's ranks fail at
once, naming the rank it blames) and, if it is a leader, tells the other leaders whom it blames
and breaks its links there, so every other host fails too.
"""
from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from ...errors import DistributedError, PeerError, failure_of, with_failure
from ..base import Backend, ReduceOp
from ..protocol import OP_CODES
from .shm import Placement, SharedGroup

OP_ALL_REDUCE, OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_BROADCAST, OP_BARRIER = (
    OP_CODES[name] for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier"))


class Leaders(Protocol):
    """The leaders' group: a Backend, and what the stages need of it beyond the contract."""

    def set_stage(self, op_code: int, detail: int) -> None:
        """Tag the next collectives' headers as a stage of the group's operation op_code (detail:
        its broadcast's root); (0, 0) ends the tagging."""

    def notify_outer(self, culprit: int) -> None:
        """Tell the other leaders this rank gives up because of rank `culprit` of the whole
        group (-1: an error of its own); best effort, without waiting long."""

    def break_links(self, why: str) -> None:
        """Fail the leaders' group now: the other leaders waiting on this one fail at once."""


class Staging:
    """Where this rank is (its host's members, its segment) and the leaders' group, if a leader.

    kind names the leaders' group in errors ("ring", "mesh")."""

    def __init__(self, rank: int, placement: Placement, leaders: "Backend | None", kind: str) -> None:
        self.rank = rank
        self.hosts = placement.hosts
        self.host_of = {q: h for h, members in enumerate(self.hosts) for q in members}
        self.host = self.host_of[rank]
        self.members = self.hosts[self.host]
        self.local: SharedGroup | None = placement.group  # None: the only rank on its host
        self.leaders = leaders                            # None: not its host's first rank
        self.leader_ranks = [members[0] for members in self.hosts]
        self.widest = max(len(members) for members in self.hosts)
        self.kind = kind
        self._timeout: float | None = None
        self._scratch: dict = {}

    def buffer(self, tag: str, dtype: np.dtype, count: int) -> np.ndarray:
        key = (tag, np.dtype(dtype))
        buf = self._scratch.get(key)
        if buf is None or buf.size < count:
            buf = self._scratch[key] = np.zeros(max(count, 1), dtype)
        return buf[:count]

    def between_hosts(self, op_code: int, detail: int, call: Callable[[Backend], None]) -> None:
        """Run call(leaders' group) as a stage of the group's operation op_code (detail: its root
        for a broadcast); errors are reworded by ranks of the group."""
        leaders = self.leaders
        assert leaders is not None
        leaders.set_stage(op_code, detail)  # type: ignore[attr-defined]
        try:
            call(leaders)
        except DistributedError as exc:
            raise self._reworded(exc) from None
        finally:
            leaders.set_stage(0, 0)  # type: ignore[attr-defined]

    def _reworded(self, exc: DistributedError) -> DistributedError:
        failure = failure_of(exc)
        outer = failure.outer_culprit
        culprit = -1 if failure.culprit is None else failure.culprit
        if outer is not None:
            culprit = outer
        elif 0 <= culprit < len(self.leader_ranks):
            culprit = self.leader_ranks[culprit]
        where = (f"the {self.kind} of each host's first rank (whose ranks "
                 f"{', '.join(map(str, range(len(self.leader_ranks))))} "
                 f"are ranks {', '.join(map(str, self.leader_ranks))} of this group)")
        if isinstance(exc, PeerError) and culprit >= 0:
            new = PeerError(f"rank {self.rank}: rank {culprit} died or failed, as seen between hosts in {where}: {exc}")
        else:
            new = type(exc)(f"rank {self.rank}: between hosts, in {where}: {exc}")
        with_failure(new, culprit=culprit)
        new.from_leaders = True  # type: ignore[attr-defined]
        return new

    def start(self, deadline: float, timeout: float, what: object) -> None:
        """A collective starts (local/shell.py's on_stages): the host's stages run under
        `deadline` (what: its str() names the collective in errors), the leaders' under `timeout`."""
        if self.local is not None:
            self.local.deadline = deadline
            self.local.what = what
        if self.leaders is not None and timeout != self._timeout:
            self.leaders.set_timeout(timeout)
            self._timeout = timeout

    def fail(self, exc: BaseException) -> None:
        """This rank's collective failed: tell its host's ranks and the other leaders now."""
        culprit = failure_of(exc).culprit
        culprit = -1 if culprit is None else culprit
        if self.local is not None:
            self.local.mark_broken(culprit)
        leaders = self.leaders
        if leaders is None:
            return
        if not getattr(exc, "from_leaders", False):  # the leaders' group told its peers already
            leaders.notify_outer(culprit)  # type: ignore[attr-defined]
        leaders.break_links(f"rank {self.rank}: a collective of its group failed")  # type: ignore[attr-defined]

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
            self.local = None
        if self.leaders is not None:
            self.leaders.close()
            self.leaders = None


def form(group: Backend, placement: Placement, kind: str) -> Staging:
    """Split `group` into the leaders' group (the collective every rank calls once; group.split
    must return a Leaders for the leaders). On failure the host's segment is closed."""
    rank = group.rank()
    leader = any(members[0] == rank for members in placement.hosts)
    try:
        # The other ranks each get a group of their own (no connections), closed at once.
        sub = group.split(0 if leader else 1 + rank, rank)
    except BaseException:
        if placement.group is not None:
            placement.group.close()
        raise
    if not leader:
        sub.close()
    return Staging(rank, placement, sub if leader else None, kind)


def all_reduce(h: Staging, header: bytes, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
    if h.local is not None:
        h.local.all_reduce(header, src, dst, op)
    else:
        dst[...] = src
    if h.leaders is not None:
        h.between_hosts(OP_ALL_REDUCE, 0, lambda leaders: leaders.all_reduce(dst, dst, op))
    if h.local is not None:
        h.local.broadcast(None, dst, 0)


def reduce_scatter(h: Staging, header: bytes, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
    m, k = dst.size, len(h.members)
    full = h.buffer("reduce_scatter full", src.dtype, src.size)
    if h.local is not None:
        h.local.all_reduce(header, src, full, op)
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
        h.between_hosts(OP_REDUCE_SCATTER, 0, lambda leaders: leaders.reduce_scatter(laid_out, ours, op))
    if h.local is not None:
        h.local.broadcast(None, ours[:k * m], 0)
    j = h.members.index(h.rank)
    dst[...] = ours[j * m:(j + 1) * m]


def all_gather(h: Staging, header: bytes, src: np.ndarray, dst: np.ndarray) -> None:
    m, k = src.size, len(h.members)
    # Every host sends `widest` blocks (the leaders' all_gather needs one size); the padding is
    # zeros, never another call's data.
    host_blocks = h.buffer("all_gather host", src.dtype, h.widest * m)
    host_blocks[k * m:] = 0
    if h.local is not None:
        h.local.all_gather(header, src, host_blocks[:k * m])
    else:
        host_blocks[:m] = src
    if h.leaders is not None:
        table = h.buffer("all_gather table", src.dtype, len(h.hosts) * h.widest * m)
        h.between_hosts(OP_ALL_GATHER, 0, lambda leaders: leaders.all_gather(host_blocks, table))
        for host, members in enumerate(h.hosts):
            for j, q in enumerate(members):
                at = (host * h.widest + j) * m
                dst[q * m:(q + 1) * m] = table[at:at + m]
    if h.local is not None:
        h.local.broadcast(None, dst, 0)


def broadcast(h: Staging, header: bytes, buf: np.ndarray, root: int) -> None:
    root_host = h.host_of[root]
    on_root_host = h.host == root_host
    if h.local is not None and on_root_host:
        h.local.broadcast(header, buf, h.members.index(root))
    if h.leaders is not None:
        h.between_hosts(OP_BROADCAST, root, lambda leaders: leaders.broadcast(buf, root_host))
    if h.local is not None and not on_root_host:
        h.local.broadcast(header, buf, 0)


def barrier(h: Staging, header: bytes) -> None:
    if h.local is not None:
        h.local.barrier(header)
    if h.leaders is not None:
        h.between_hosts(OP_BARRIER, 0, lambda leaders: leaders.barrier())
    if h.local is not None:
        h.local.barrier()
