"""JACCL's collectives over shared memory: when every rank of a JACCL group is on this host (and
JACKLRING_LOCAL_TRANSPORT is auto or shm), all_reduce, reduce_scatter, all_gather, broadcast and
barrier run through local/SharedGroup.py over one segment formed with the group; send/recv stay
on the mesh (TCP or RDMA), whose connections the segment also watches.

When the group spans hosts and some host has several of its ranks, those collectives run in
stages (local/staged.py, as the ring's): each host's ranks combine in their segment, the first
rank of each host runs the part between hosts on the leaders' mesh (a split of the group, one
rank per host, TCP or RDMA like the group), and hands the result back in memory. The leaders'
frames carry the group's operation in their extra field (exchange.stage_tag); a leader that
gives up tells the others whom it blames by rank of the whole group (the TCP mesh's notice).

Each collective opens with a 24-byte header in the layout of JACCL's frame header
(exchange.HEADER: kind, reduce op, dtype code, phase 0, the group's collective count, frame 0,
extra (a broadcast's root), byte count), so ranks that disagree raise MismatchError worded by
protocol.mismatch_message, as on the mesh.
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from ...errors import DistributedError
from ..base import GroupFailure, ReduceOp
from ..elements import DTYPE_CODES, dtype_code
from ..local import staged, use
from ..local.segment import OP_CODES as ENGINE_OPS
from ..local.segment import SharedGroup
from ..local.shell import JACCL_HEADER, CollectiveShell
from ..local.shm import Placement
from ..local.staged import Staging
from ..protocol import OP_CODES, REDUCE_CODES, Request, mismatch_message
from ..transport.slots import Transport
from .exchange import HEADER, SEQ_MASK

log = logging.getLogger("jacklring.jaccl")

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, BARRIER = (
    OP_CODES[name] for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier"))


def header_request(raw: bytes) -> tuple[Request, int]:
    """The request a shared-memory header carries, and the collective count it was sent at."""
    kind, reduce, dtype, _phase, seq, _frame, extra, nbytes = HEADER.unpack(raw)
    return Request(kind, reduce, dtype, nbytes, extra), seq


def describe(raw: bytes) -> str:
    request, seq = header_request(raw)
    return request.label(seq)


def mismatch(rank: int, peer: int, mine: bytes, theirs: bytes) -> str:
    (a, seq_a), (b, seq_b) = header_request(mine), header_request(theirs)
    counts = "" if seq_a == seq_b else f" (collective #{seq_a} here, #{seq_b} on rank {peer})"
    return mismatch_message(rank, peer, a, b, f"{counts} [shared memory]")


def attach(rank: int, size: int, gather: Callable[[bytes], list[bytes]], transport: Transport) -> Placement:
    """Find which ranks share a host and give each such host a segment (placement.shared False:
    none anywhere, the mesh carries the collectives). A group all on this host also watches the
    mesh's connections. A collective: every rank calls it, gather all-gathers over the mesh."""
    placement = use.attach(rank, size, gather, describe, mismatch)
    group = placement.group
    if group is None or len(placement.hosts) > 1:
        return placement
    links = getattr(transport, "links", None)  # the TCP mesh's sockets; verbs has none to watch
    if links is not None:
        for fd, label, peer in links():
            group.watch(fd, label, peer)
    log.debug("rank %d: JACCL collectives over shared memory (%d ranks on this host)", rank, size)
    return placement


class SharedCollectives:
    """One JACCL group's collectives over its segment (group) or in stages (staging): one at a
    time (the group's lock), numbered, under the group's timeout, fatal to the group on error."""

    def __init__(self, group: SharedGroup | None, staging: Staging | None, timeout: float, failure: GroupFailure,
                 busy: object, refuse: Callable[[str], DistributedError]) -> None:
        self.group = group
        self.staging = staging
        self._timeout = timeout
        self._fast: object | None = None  # the engine's one-call collectives (fast_path())
        self._failure = failure
        # One collective at a time (refused while another thread runs one), numbered, with
        # header, deadline and failure: the same shell as the ring's (local/shell.py).
        self._shell = CollectiveShell(failure, describe, self._failed, lock=busy, refuse=refuse)
        self._shell.attach(group)  # the segment keeps the count
        self._size = group.size if group is not None else len(staging.host_of)  # type: ignore[union-attr]
        self._rank = group.rank if group is not None else staging.rank  # type: ignore[union-attr]

    @property
    def timeout(self) -> float:
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._timeout = seconds
        if self._fast is not None:
            self._fast.timeout = seconds  # type: ignore[attr-defined]

    def fast_path(self) -> object | None:
        """The engine's one-call collectives over the whole group's segment, in JACCL's header
        layout (None when the group is staged or has no segment); all_reduce tries it first."""
        if self.group is not None:
            reduces = [REDUCE_CODES[op] for op, _ in sorted(ENGINE_OPS.items(), key=lambda item: item[1])]
            op_codes = [ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST, BARRIER]
            self._fast = self._shell.fast_path(self._timeout, 0, op_codes, reduces, JACCL_HEADER)
        return self._fast

    def _failed(self, exc: BaseException) -> None:
        self._failure.mark(f"{type(exc).__name__}: {exc}")

    def _run(self, what: str, kind: int, reduce: int, arr: np.ndarray | None, extra: int, body, *args) -> None:
        # JACCL's headers carry the collective's own number (the count after it).
        seq = (self._shell.seq + 1) & SEQ_MASK
        if arr is None:
            header = HEADER.pack(kind, 0, 0, 0, seq, 0, 0, 0)
        else:
            code = DTYPE_CODES.get(arr.dtype) or dtype_code(arr.dtype)
            header = HEADER.pack(kind, reduce, code, 0, seq, 0, extra, arr.nbytes)
        if self.staging is not None:
            self._shell.on_stages(header, self._timeout, self.staging, body, *args, name=what)
        else:
            self._shell.on_segment(header, self._timeout, self.group, body, *args, name=what)  # type: ignore[arg-type]

    def all_reduce(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        fast = self._fast  # the engine's one call when it takes this one (a caller of the backend)
        if fast is not None and fast.all_reduce(src, dst, ENGINE_OPS[op]) is not NotImplemented:  # type: ignore[attr-defined]
            return
        body = staged.all_reduce if self.staging is not None else SharedGroup.all_reduce
        self._run("all_reduce", ALL_REDUCE, REDUCE_CODES[op], src, 0, body, src, dst, op)

    def reduce_scatter(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        body = staged.reduce_scatter if self.staging is not None else SharedGroup.reduce_scatter
        self._run("reduce_scatter", REDUCE_SCATTER, REDUCE_CODES[op], src, 0, body, src, dst, op)

    def all_gather(self, src: np.ndarray, dst: np.ndarray) -> None:
        body = staged.all_gather if self.staging is not None else SharedGroup.all_gather
        self._run("all_gather", ALL_GATHER, 0, src, 0, body, src, dst)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if not 0 <= root < self._size:
            raise DistributedError(f"rank {self._rank}: broadcast root {root} is not a rank of this group "
                                   f"of size {self._size}")
        body = staged.broadcast if self.staging is not None else SharedGroup.broadcast
        self._run("broadcast", BROADCAST, 0, buf, root, body, buf, root)

    def barrier(self) -> None:
        self._run("barrier", BARRIER, 0, None, 0, staged.barrier if self.staging is not None else SharedGroup.barrier)

    def break_links(self) -> None:
        """A shared-memory wait sleeps on the segment, not the links: mark it broken (and, staged,
        fail the leaders' mesh too)."""
        if self.group is not None:
            self.group.mark_broken()
        elif self.staging is not None:
            self.staging.fail(DistributedError("the group was given up"))

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        if self.staging is not None:
            self.staging.close()
