"""JACCL's mesh with the log-latency schedules of backends/algorithms, chosen by size and group
size (algorithms/selection.py); everything else stays MeshAlgorithms' (algorithms.py).

Each step of a schedule is one FrameExchange.transfer tagged with the step as its phase and
carrying the collective's request, so a peer that runs another collective (or is at another
step) is a MismatchError naming both, and a dead or silent peer is named as in every other JACCL
collective (exchange.py, transport/blame.py).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ..algorithms import schedules
from ..algorithms.selection import Chooser
from ..base import ReduceOp
from ..protocol import Request
from .algorithms import MeshAlgorithms
from .algorithms import request_for as _request
from .exchange import FrameExchange


class MeshPeers:
    """PeerExchange (algorithms/peers.py) over JACCL's framed exchange: one transfer per step."""

    def __init__(self, link: FrameExchange, size: int) -> None:
        self.rank, self.size = link.rank, size
        self._link = link
        self.request: Request | None = None
        self.deadline = 0.0

    def start(self, request: Request) -> "MeshPeers":
        self.request = request
        self.deadline = self._link.deadline()
        return self

    def sendrecv(self, step: int, sends: Mapping[int, memoryview], recvs: Mapping[int, memoryview]) -> None:
        assert self.request is not None
        self._link.transfer(self.request, dict(sends), dict(recvs), self.deadline, phase=step)


class ScheduledMesh:
    """MeshAlgorithms' interface: a collective runs a schedule when the chooser says so."""

    def __init__(self, mesh: MeshAlgorithms, link: FrameExchange, size: int) -> None:
        self._mesh = self.mesh = mesh  # mesh: the schedules of algorithms.py, for tests to look at
        self._peers = MeshPeers(link, size)
        self.chooser = Chooser("jaccl", size)
        self._scratch: dict[tuple[str, np.dtype], np.ndarray] = {}
        self.send, self.recv = mesh.send, mesh.recv

    def _buffer(self, tag: str, dtype: np.dtype, count: int) -> np.ndarray:
        buf = self._scratch.get((tag, dtype))
        if buf is None or buf.size < count:
            buf = self._scratch[(tag, dtype)] = np.empty(max(count, 1), dtype)
        return buf[:count]

    def all_reduce(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        choice = self.chooser.choose("all_reduce", src.nbytes)
        if choice == "native":
            return self._mesh.all_reduce(src, dst, op)
        peers = self._peers.start(_request("all_reduce", src, op))
        run = schedules.all_reduce_doubling if choice == "rd" else schedules.all_reduce_halving
        run(peers, src, dst, op, self._buffer("scratch", src.dtype, src.size))

    def all_gather(self, src: np.ndarray, dst: np.ndarray) -> None:
        if self.chooser.choose("all_gather", src.nbytes) == "native":
            return self._mesh.all_gather(src, dst)
        schedules.all_gather_doubling(self._peers.start(_request("all_gather", src)), src, dst)

    def reduce_scatter(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        if self.chooser.choose("reduce_scatter", src.nbytes) == "native":
            return self._mesh.reduce_scatter(src, dst, op)
        peers = self._peers.start(_request("reduce_scatter", src, op))
        schedules.reduce_scatter_halving(peers, src, dst, op, self._buffer("work", src.dtype, src.size),
                                         self._buffer("scratch", src.dtype, src.size))

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if self.chooser.choose("broadcast", buf.nbytes) == "native" or not 0 <= root < self._peers.size:
            return self._mesh.broadcast(buf, root)  # (a root out of range: the mesh's own error)
        schedules.broadcast_tree(self._peers.start(_request("broadcast", buf, extra=root)), buf, root)

    def barrier(self) -> None:
        if self.chooser.choose("barrier", 0) == "native":
            return self._mesh.barrier()
        schedules.barrier_dissemination(self._peers.start(_request("barrier")))
