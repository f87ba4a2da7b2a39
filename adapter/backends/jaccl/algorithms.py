"""JACCL's collectives, written against a FrameExchange (framed exchange over any transport).

Mesh (every pair of ranks directly connected):
  - small all_reduce: one step, every rank sends its data to every peer and reduces all N
    contributions in rank order, so every rank computes the same bits;
  - large all_reduce: reduce-scatter (rank j reduces block j from all peers, in rank order) then
    all-gather of the reduced blocks: each link carries 2/N of the data instead of all of it.
    The reduce-scatter reduces frame by frame out of the receive slots into the result
    (FrameExchange.reduce_transfer), so beyond src and dst it needs only the slots;
  - large broadcast (more than two ranks): the root scatters the message in one block per other
    rank, then those ranks all-gather the blocks among themselves, so the root sends the message
    once instead of once per peer.
Ring (links only between neighbours, `jaccl-ring`): the classic ring reduce-scatter and
all-gather, one block per step; each block is reduced by one chain and then copied, so the
result is identical on every rank too.
"""
from __future__ import annotations

import functools

import numpy as np

from ...errors import DistributedError
from ..base import ReduceOp
from ..elements import block_bounds, byte_view, dtype_code, reduce_into, reduce_many
from ..protocol import OP_CODES, REDUCE_CODES, Request
from .exchange import FrameExchange

# Above this, the mesh all_reduce uses reduce-scatter + all-gather (with two ranks only once the
# message needs more than one frame: below that the one-frame exchange is quicker).
MESH_LARGE_BYTES = 64 << 10
# From this size (and with more than two ranks) the mesh broadcast scatters, then all-gathers:
# below it one more step costs more than the root's extra copies.
BROADCAST_SCATTER_BYTES = 256 << 10
RING_LARGE_BYTES = 64 << 10
# Over the TCP mesh every peer's flow leaves through the same network interface. A mesh
# reduction at this size and above, with more than two ranks, waits at each step for the
# slowest of n-1 flows sharing it; the ring order (one flow each way) over the same links keeps
# the interface busy instead. RDMA meshes have a cable per pair and keep the mesh order.
SHARED_LINK_RING_BYTES = 1 << 20
_EMPTY = memoryview(b"")


def _request(kind: str, arr: np.ndarray | None = None, op: ReduceOp | None = None, extra: int = 0) -> Request:
    if arr is None:
        return _cached_request(kind, None, 0, op, extra)
    return _cached_request(kind, arr.dtype, arr.nbytes, op, extra)


request_for = _request  # the request of a collective, for the schedules of scheduled.py


@functools.lru_cache(maxsize=512)
def _cached_request(kind: str, dtype, nbytes: int, op: ReduceOp | None, extra: int) -> Request:
    """Requests repeat (the same op on the same sizes every step): build each once."""
    return Request(OP_CODES[kind], REDUCE_CODES[op] if op else 0,
                   dtype_code(dtype) if dtype is not None else 0, nbytes, extra)


class _SmallPlan:
    """Everything the one-step all_reduce of one (dtype, size, op) needs, built once: the
    request, a row per rank to receive into, the receive views and the list reduce_many takes.
    Training loops repeat the same few reductions, so the latency path allocates nothing."""

    __slots__ = ("request", "rows", "own", "own_bytes", "targets", "parts")

    def __init__(self, request: Request, dtype: np.dtype, count: int, rank: int, peers: list[int]) -> None:
        self.request = request
        self.rows = np.empty((len(peers) + 1, count), dtype)
        self.own = self.rows[rank]
        self.own_bytes = byte_view(self.own)
        row_bytes = byte_view(self.rows)
        width = count * self.rows.itemsize
        self.targets = {p: row_bytes[p * width:(p + 1) * width] for p in peers}
        self.parts = list(self.rows)


class Algorithms:
    """Point-to-point operations and checks shared by both topologies."""

    def __init__(self, link: FrameExchange, size: int) -> None:
        self.link = link
        self.rank = link.rank
        self.size = size

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise DistributedError(f"rank {self.rank}: {what} rank {peer} is not another rank of this "
                                   f"group of size {self.size}")
        if peer not in self.link.sent:
            raise DistributedError(f"rank {self.rank}: {what} rank {peer} is not a neighbour; in JACCL "
                                   f"ring mode only ring neighbours {sorted(self.link.sent)} are connected")

    def send(self, buf: np.ndarray, dst: int) -> None:
        self._check_peer(dst, "send to")
        self.link.transfer(_request("send", buf, extra=dst), {dst: byte_view(buf)}, {}, self.link.deadline())

    def recv(self, buf: np.ndarray, src: int) -> None:
        self._check_peer(src, "recv from")
        expect = _request("send", buf, extra=self.rank)
        self.link.transfer(_request("recv", buf, extra=src), {}, {src: byte_view(buf)}, self.link.deadline(),
                           expect=expect)


class MeshAlgorithms(Algorithms):
    def __init__(self, link: FrameExchange, size: int, shared_link: bool = False) -> None:
        """shared_link: every peer is reached through one network interface (the TCP mesh)."""
        super().__init__(link, size)
        self._peer_list = [p for p in range(size) if p != self.rank]
        self._plans: dict[tuple, _SmallPlan] = {}
        self._ring = RingAlgorithms(link, size) if shared_link and size > 2 else None

    def _peers(self) -> list[int]:
        return self._peer_list

    def all_reduce(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        nbytes = src.nbytes
        if self._ring is not None and nbytes >= SHARED_LINK_RING_BYTES:
            self._ring.all_reduce(src, dst, op)
        elif nbytes <= self.link.payload and (self.size <= 2 or nbytes < MESH_LARGE_BYTES):
            self._all_reduce_small(src, dst, op)
        elif nbytes >= MESH_LARGE_BYTES and src.size >= self.size:
            self._all_reduce_blocks(_request("all_reduce", src, op), src, dst, op)
        else:
            self._all_reduce_one_step(_request("all_reduce", src, op), src, dst, op)

    def _all_reduce_small(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        """One frame to and from every peer, then a reduction in rank order."""
        key = (src.dtype.num, src.size, op)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 64:
                self._plans.clear()
            plan = self._plans[key] = _SmallPlan(_request("all_reduce", src, op), src.dtype, src.size,
                                                 self.rank, self._peer_list)
        # The own row is a copy: dst may alias src, and reduce_many reads every part after the first.
        plan.own[...] = src
        self.link.transfer(plan.request, dict.fromkeys(self._peer_list, plan.own_bytes), plan.targets,
                           self.link.deadline())
        reduce_many(dst, plan.parts, op)

    def _gather_rows(self, request: Request, sends: dict[int, memoryview], row_len: int,
                     own: np.ndarray, deadline: float, phase: int = 0) -> np.ndarray:
        """Receive a row of row_len elements from every peer; own fills this rank's row."""
        rows = np.empty((self.size, row_len), own.dtype)
        rows[self.rank] = own
        row_bytes = row_len * own.itemsize
        flat = byte_view(rows)
        self.link.transfer(request, sends, {p: flat[p * row_bytes:(p + 1) * row_bytes] for p in self._peers()},
                           deadline, phase)
        return rows

    def _reduce_block(self, request: Request, sends: dict[int, memoryview], own: np.ndarray, out: np.ndarray,
                      op: ReduceOp, deadline: float) -> None:
        """out = op over every rank's part of this rank's block in rank order (own: this rank's
        part; the peers' arrive while sends go out). A part that fits one frame takes the latency
        path (rows of one frame each); larger ones are reduced frame by frame from the slots."""
        if own.nbytes <= self.link.payload:
            rows = self._gather_rows(request, sends, own.size, own, deadline)
            reduce_many(out, list(rows), op)
        else:
            self.link.reduce_transfer(request, sends, own, out, op, deadline)

    def _all_reduce_one_step(self, request: Request, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        data = byte_view(src)
        rows = self._gather_rows(request, {p: data for p in self._peers()}, src.size, src, self.link.deadline())
        reduce_many(dst, list(rows), op)

    def _all_reduce_blocks(self, request: Request, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        deadline = self.link.deadline()
        bounds = block_bounds(src.size, self.size)
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        peers = self._peers()
        sends = {p: byte_view(src[bounds[p]:bounds[p + 1]]) for p in peers}
        # Only block `rank` of dst is written while src's other blocks are sent: dst may alias src.
        self._reduce_block(request, sends, src[lo:hi], dst[lo:hi], op, deadline)
        item = src.itemsize
        out = byte_view(dst)
        self.link.transfer(request, {p: out[lo * item:hi * item] for p in peers},
                           {p: out[bounds[p] * item:bounds[p + 1] * item] for p in peers}, deadline, phase=1)

    def all_gather(self, src: np.ndarray, dst: np.ndarray) -> None:
        data = byte_view(src)
        peers = self._peers()
        out, n = byte_view(dst), src.nbytes
        self.link.transfer(_request("all_gather", src), {p: data for p in peers},
                           {p: out[p * n:(p + 1) * n] for p in peers}, self.link.deadline())
        dst[self.rank * src.size:(self.rank + 1) * src.size] = src

    def reduce_scatter(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        n = dst.size
        sends = {p: byte_view(src[p * n:(p + 1) * n]) for p in self._peers()}
        own = src[self.rank * n:(self.rank + 1) * n]
        self._reduce_block(_request("reduce_scatter", src, op), sends, own, dst, op, self.link.deadline())

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        request = _request("broadcast", buf, extra=root)
        if self.size > 2 and buf.nbytes >= BROADCAST_SCATTER_BYTES and buf.size >= self.size - 1:
            self._broadcast_scattered(request, buf, root)
        elif root == self.rank:
            peers = self._peers()
            # Receivers answer with a header-only message so the root also sees a mismatch.
            self.link.transfer(request, {p: byte_view(buf) for p in peers}, {p: _EMPTY for p in peers},
                               self.link.deadline())
        else:
            self._check_peer(root, "broadcast root")
            self.link.transfer(request, {root: _EMPTY}, {root: byte_view(buf)}, self.link.deadline())

    def _broadcast_scattered(self, request: Request, buf: np.ndarray, root: int) -> None:
        """Step 0: the root sends block i to others[i] (the ranks but the root, in order). Step 1:
        those ranks all-gather the blocks among themselves; each also sends the root a header,
        so the root sees a mismatch, as every rank does on the short path."""
        if root != self.rank:
            self._check_peer(root, "broadcast root")
        deadline = self.link.deadline()
        others = [p for p in range(self.size) if p != root]
        bounds = block_bounds(buf.size, len(others))
        item = buf.itemsize
        data = byte_view(buf)
        block = {p: data[bounds[i] * item:bounds[i + 1] * item] for i, p in enumerate(others)}
        if root == self.rank:
            self.link.transfer(request, block, {}, deadline, phase=0)
            self.link.transfer(request, {}, dict.fromkeys(others, _EMPTY), deadline, phase=1)
            return
        mine = block[self.rank]
        self.link.transfer(request, {}, {root: mine}, deadline, phase=0)
        peers = [p for p in others if p != self.rank]
        sends = {p: mine for p in peers}
        sends[root] = _EMPTY
        self.link.transfer(request, sends, {p: block[p] for p in peers}, deadline, phase=1)

    def barrier(self) -> None:
        peers = self._peers()
        self.link.transfer(_request("barrier"), {p: _EMPTY for p in peers}, {p: _EMPTY for p in peers},
                           self.link.deadline())


class RingAlgorithms(Algorithms):
    def __init__(self, link: FrameExchange, size: int) -> None:
        super().__init__(link, size)
        self.left = (self.rank - 1) % size
        self.right = (self.rank + 1) % size

    def _step(self, request: Request, phase: int, send: memoryview, recv_into: memoryview,
              deadline: float) -> None:
        """Send to the right neighbour while receiving from the left one."""
        self.link.transfer(request, {self.right: send}, {self.left: recv_into}, deadline, phase)

    def _ring_all_gather(self, request: Request, blocks: list[memoryview], deadline: float,
                         first_phase: int = 0) -> None:
        """blocks[r] (this rank's) is filled; after N-1 steps every block is."""
        n, r = self.size, self.rank
        for s in range(n - 1):
            self._step(request, first_phase + s, blocks[(r - s) % n], blocks[(r - s - 1) % n], deadline)

    def _ring_reduce_scatter(self, request: Request, acc: np.ndarray, bounds: list[int], op: ReduceOp,
                             deadline: float) -> None:
        """Reduce acc across ranks so that acc's block `rank` holds the full result. Each
        incoming block is reduced frame by frame out of the receive slots into acc."""
        n, r = self.size, self.rank
        order = [self.left, r]   # op(incoming, ours), as every hop of the chain computes it
        largest = max(bounds[i + 1] - bounds[i] for i in range(n))
        # Blocks of one frame take the latency path through a one-block scratch.
        scratch = np.empty(largest, acc.dtype) if largest * acc.itemsize <= self.link.payload else None
        for s in range(n - 1):
            out_i, in_i = (r - s - 1) % n, (r - s - 2) % n
            send = byte_view(acc[bounds[out_i]:bounds[out_i + 1]])
            block = acc[bounds[in_i]:bounds[in_i + 1]]
            if scratch is None:
                self.link.reduce_transfer(request, {self.right: send}, block, block, op, deadline, s, order)
                continue
            incoming = scratch[:block.size]
            self._step(request, s, send, byte_view(incoming), deadline)
            reduce_into(block, incoming, block, op)

    def all_reduce(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        request = _request("all_reduce", src, op)
        deadline = self.link.deadline()
        n = self.size
        if src.nbytes < RING_LARGE_BYTES or src.size < n:
            rows = np.empty((n, src.size), src.dtype)
            rows[self.rank] = src
            self._ring_all_gather(request, [byte_view(row) for row in rows], deadline)
            reduce_many(dst, list(rows), op)
            return
        bounds = block_bounds(src.size, n)
        if dst is not src:   # dst is the working buffer: no third copy of the message
            dst[...] = src
        self._ring_reduce_scatter(request, dst, bounds, op, deadline)
        self._ring_all_gather(request, [byte_view(dst[bounds[i]:bounds[i + 1]]) for i in range(n)],
                              deadline, first_phase=n)

    def all_gather(self, src: np.ndarray, dst: np.ndarray) -> None:
        k = src.size
        dst[self.rank * k:(self.rank + 1) * k] = src
        self._ring_all_gather(_request("all_gather", src),
                              [byte_view(dst[i * k:(i + 1) * k]) for i in range(self.size)], self.link.deadline())

    def reduce_scatter(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        k = dst.size
        acc = src.copy()
        self._ring_reduce_scatter(_request("reduce_scatter", src, op), acc,
                                  [i * k for i in range(self.size + 1)], op, self.link.deadline())
        dst[...] = acc[self.rank * k:(self.rank + 1) * k]

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if not 0 <= root < self.size:
            raise DistributedError(f"rank {self.rank}: broadcast root {root} is not a rank of this group "
                                   f"of size {self.size}")
        request = _request("broadcast", buf, extra=root)
        deadline = self.link.deadline()
        position = (self.rank - root) % self.size
        if 0 < position < self.size - 1 and buf.nbytes > self.link.payload:
            # In the middle of the chain: pass each frame on as it arrives.
            self.link.relay(request, self.left, self.right, byte_view(buf), deadline)
            return
        if position > 0:   # receive from the left, answering with a header so it can check us
            self.link.transfer(request, {self.left: _EMPTY}, {self.left: byte_view(buf)}, deadline)
        if position < self.size - 1:   # forward to the right
            self.link.transfer(request, {self.right: byte_view(buf)}, {self.right: _EMPTY}, deadline)

    def barrier(self) -> None:
        self._ring_all_gather(_request("barrier"), [_EMPTY] * self.size, self.link.deadline())
