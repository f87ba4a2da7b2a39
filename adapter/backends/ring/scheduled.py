"""The ring group's log-latency collectives: the schedules of backends/algorithms run over the
point-to-point connections (point_to_point.py) to any rank, chosen by algorithms/selection.py.

Every message carries the collective's ring header (operation, dtype, size, sequence number,
stage) before its bytes, and the receiver compares it with its own, so a peer that runs another
collective is a MismatchError naming both. A peer that dies is the PeerError point_to_point.py
names it with (its connection ends, or its address refuses connections), within about a second.
Two partners that send each other a large message do not deadlock: a blocked send reads the
partner's stream into its spill buffer (point_to_point.py).
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from ..algorithms import schedules
from ..algorithms.selection import Chooser
from ..base import ReduceOp
from .header import HEADER
from .point_to_point import PointToPoint

_HS = HEADER.size


class RingPeers:
    """PeerExchange (algorithms/peers.py) over a ring group's point-to-point connections."""

    def __init__(self, rank: int, size: int, p2p: PointToPoint,
                 check_header: Callable[[bytes, memoryview, int], None]) -> None:
        self.rank, self.size = rank, size
        self._p2p = p2p
        self._check = check_header
        self.header = b""
        self._out = np.empty(0, np.uint8)
        self._in = np.empty(0, np.uint8)

    def expect(self, partners: set[int]) -> None:
        """The partners of the schedule about to run (point_to_point.py tells them of a failure)."""
        self._p2p.expected = partners

    def _grown(self, buf: np.ndarray, nbytes: int) -> np.ndarray:
        return buf if buf.size >= nbytes else np.empty(max(nbytes, 2 * buf.size, 4096), np.uint8)

    def sendrecv(self, step: int, sends: Mapping[int, memoryview], recvs: Mapping[int, memoryview]) -> None:
        # Sends first: a partner that sends to this rank meanwhile fills the spill (point_to_point.py).
        for peer, data in sends.items():
            total = _HS + len(data)
            self._out = out = self._grown(self._out, total)
            out[:_HS] = np.frombuffer(self.header, np.uint8)
            out[_HS:total] = np.frombuffer(data, np.uint8)
            self._p2p.send(out[:total], peer)
        for peer, view in recvs.items():
            total = _HS + len(view)
            self._in = inp = self._grown(self._in, total)
            self._p2p.recv(inp[:total], peer)
            self._check(self.header, memoryview(inp[:_HS]), peer)
            if total > _HS:
                view[:] = memoryview(inp[_HS:total])


class Scheduled:
    """The collectives a ring group runs by a schedule of algorithms/ (the caller runs them inside
    Plumbing.collective, which serialises them, numbers them and handles failure)."""

    def __init__(self, peers: RingPeers, buffer: Callable[[str, np.dtype, int], np.ndarray],
                 between_hosts: bool = True) -> None:
        self._peers = peers
        self._buffer = buffer
        self.chooser = Chooser("ring", peers.size, between_hosts)

    def choose(self, collective: str, nbytes: int) -> str:
        return self.chooser.choose(collective, nbytes)

    def _start(self, header: bytes, partners: set[int]) -> None:
        self._peers.header = header
        self._peers.expect(partners)

    def all_reduce(self, header: bytes, choice: str, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        self._start(header, schedules.pair_partners(self._peers.size, self._peers.rank))
        scratch = self._buffer("alg-scratch", src.dtype, src.size)
        run = schedules.all_reduce_doubling if choice == "rd" else schedules.all_reduce_halving
        run(self._peers, src, dst, op, scratch)

    def reduce_scatter(self, header: bytes, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        self._start(header, schedules.pair_partners(self._peers.size, self._peers.rank))
        work = self._buffer("alg-work", src.dtype, src.size)
        scratch = self._buffer("alg-scratch", src.dtype, src.size)
        schedules.reduce_scatter_halving(self._peers, src, dst, op, work, scratch)

    def all_gather(self, header: bytes, src: np.ndarray, dst: np.ndarray) -> None:
        self._start(header, schedules.pair_partners(self._peers.size, self._peers.rank))
        schedules.all_gather_doubling(self._peers, src, dst)

    def broadcast(self, header: bytes, buf: np.ndarray, root: int) -> None:
        self._start(header, schedules.tree_partners(self._peers.size, self._peers.rank, root))
        schedules.broadcast_tree(self._peers, buf, root)

    def barrier(self, header: bytes) -> None:
        self._start(header, schedules.dissemination_partners(self._peers.size, self._peers.rank))
        schedules.barrier_dissemination(self._peers)
