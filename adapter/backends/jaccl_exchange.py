"""Framed, checked, pipelined message exchange over a JACCL transport.

Every message an algorithm sends is cut into frames that fit one transport slot; every frame
starts with a header naming the request it belongs to (operation, reduction, dtype, byte
count, root), the message's sequence number on that link and the frame's index. The receiver
compares the first frame's header with what it expects, so two ranks that issued different
operations both raise MismatchError naming both requests instead of corrupting data or hanging.

`Link.transfer` moves one message to each of several peers and one from each of several peers at
once, keeping `slots` frames in flight per peer and direction.
"""
from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Callable

from ..errors import DistributedError, MismatchError
from .elements import CODE_NAMES
from .jaccl_transport import SEND, Transport

# kind, reduce op, dtype code, phase, sequence, frame index, extra (root / peer), request bytes
HEADER = struct.Struct("<BBBBIIiQ")

KIND_NAMES = {1: "all_reduce", 2: "all_gather", 3: "reduce_scatter", 4: "broadcast",
              5: "barrier", 6: "send", 7: "split", 8: "recv"}
KIND_CODES = {name: code for code, name in KIND_NAMES.items()}
REDUCE_CODES = {"sum": 1, "prod": 2, "max": 3, "min": 4, "band": 5, "bor": 6, "bxor": 7}
REDUCE_NAMES = {code: name for name, code in REDUCE_CODES.items()}


@dataclass(frozen=True)
class Request:
    """What one rank asked for; every rank taking part must ask for the same thing."""
    kind: int
    reduce: int = 0
    dtype: int = 0
    nbytes: int = 0
    extra: int = 0

    def describe(self) -> str:
        name = KIND_NAMES.get(self.kind, f"unknown operation {self.kind}")
        if self.reduce:
            name += f"({REDUCE_NAMES.get(self.reduce, self.reduce)})"
        dtype = CODE_NAMES.get(self.dtype, "bytes") if self.dtype else "bytes"
        text = f"{name} of {self.nbytes} bytes ({dtype})"
        if self.kind == KIND_CODES["broadcast"]:
            text += f" from root {self.extra}"
        elif self.kind == KIND_CODES["send"]:
            text += f" to rank {self.extra}"
        elif self.kind == KIND_CODES["recv"]:
            text += f" from rank {self.extra}"
        return text


class Link:
    """One rank's view of its connections: a transport plus per-peer message counters."""

    def __init__(self, transport: Transport, timeout: float) -> None:
        self.t = transport
        self.rank = transport.rank
        self.timeout = timeout
        self.sent = {p: 0 for p in transport.peers}
        self.received = {p: 0 for p in transport.peers}
        self.broken: str | None = None
        self.payload = transport.frame_bytes - HEADER.size

    def deadline(self) -> float:
        return time.monotonic() + self.timeout

    def check_usable(self) -> None:
        if self.broken is not None:
            raise DistributedError(f"rank {self.rank}: this JACCL group is unusable after an earlier "
                                   f"error ({self.broken}); create a new one")

    def frames(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.payload))

    def transfer(self, request: Request, sends: dict[int, memoryview], recvs: dict[int, int],
                 deliver: Callable[[int, int, memoryview], None], deadline: float, phase: int = 0,
                 expect: Request | None = None) -> None:
        """Send sends[peer] (bytes) to each peer and receive recvs[peer] bytes from each peer,
        calling deliver(peer, offset, chunk) for every received chunk in order. `expect` is the
        request the senders should have made (default: the same as ours)."""
        self.check_usable()
        payload = self.payload
        single = all(len(v) <= payload for v in sends.values()) and all(n <= payload for n in recvs.values())
        try:
            kind = _OneFrame if single else _Transfer
            kind(self, request, expect or request, phase, sends, recvs, deliver, deadline).run()
        except BaseException as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            raise


class _Transfer:
    def __init__(self, link: Link, request: Request, expect: Request, phase: int,
                 sends: dict[int, memoryview], recvs: dict[int, int],
                 deliver: Callable[[int, int, memoryview], None], deadline: float) -> None:
        self.link = link
        self.t = link.t
        self.request = request
        self.expect = expect
        self.phase = phase
        self.sends = {p: memoryview(v).cast("B") for p, v in sends.items()}
        self.recvs = recvs
        self.deliver = deliver
        self.deadline = deadline
        self.seq_out = {p: link.sent[p] for p in sends}
        self.seq_in = {p: link.received[p] for p in recvs}
        self.next_send = {p: 0 for p in sends}          # next frame index to post
        self.unacked = {p: 0 for p in sends}            # posted send frames not yet completed
        self.total_out = {p: link.frames(len(v)) for p, v in self.sends.items()}
        self.total_in = {p: link.frames(n) for p, n in recvs.items()}
        self.next_post = {p: 0 for p in recvs}          # next frame index to post a receive for
        self.next_recv = {p: 0 for p in recvs}          # next frame index to consume
        self.ready: dict[tuple[int, int], int] = {}     # (peer, slot) -> completed bytes

    def run(self) -> None:
        slots = self.t.slots
        for p in self.recvs:
            while self.next_post[p] < min(slots, self.total_in[p]):
                self._post_recv(p)
        for p in self.sends:
            while self.next_send[p] < min(slots, self.total_out[p]):
                self._post_send(p)
        while self._busy():
            for c in self.t.poll(self.deadline):
                if c.kind == SEND:
                    self.unacked[c.peer] -= 1
                    if self.next_send[c.peer] < self.total_out[c.peer]:
                        self._post_send(c.peer)
                else:
                    self.ready[(c.peer, c.slot)] = c.nbytes
                    self._consume(c.peer)
        for p in self.sends:
            self.link.sent[p] += 1
        for p in self.recvs:
            self.link.received[p] += 1

    def _busy(self) -> bool:
        return (any(self.next_recv[p] < self.total_in[p] for p in self.recvs)
                or any(self.next_send[p] < self.total_out[p] or self.unacked[p] for p in self.sends))

    def _post_recv(self, peer: int) -> None:
        self.t.post_recv(peer, self.next_post[peer] % self.t.slots)
        self.next_post[peer] += 1

    def _post_send(self, peer: int) -> None:
        frame = self.next_send[peer]
        slot = frame % self.t.slots
        data = self.sends[peer]
        start = frame * self.link.payload
        chunk = data[start:start + self.link.payload]
        buf = self.t.send_buffer(peer, slot)
        r = self.request
        HEADER.pack_into(buf, 0, r.kind, r.reduce, r.dtype, self.phase, self.seq_out[peer] & 0xFFFFFFFF,
                         frame, r.extra, r.nbytes)
        buf[HEADER.size:HEADER.size + len(chunk)] = chunk
        self.t.post_send(peer, slot, HEADER.size + len(chunk))
        self.next_send[peer] += 1
        self.unacked[peer] += 1

    def _consume(self, peer: int) -> None:
        """Handle this peer's received frames in frame order (slots may complete out of order
        when they travel on different devices)."""
        slots = self.t.slots
        while self.next_recv[peer] < self.total_in[peer]:
            frame = self.next_recv[peer]
            slot = frame % slots
            nbytes = self.ready.pop((peer, slot), None)
            if nbytes is None:
                return
            buf = self.t.recv_buffer(peer, slot)
            self._check(peer, frame, buf, nbytes)
            offset = frame * self.link.payload
            want = min(self.link.payload, self.recvs[peer] - offset)
            if want > 0:
                self.deliver(peer, offset, buf[HEADER.size:HEADER.size + want])
            self.next_recv[peer] += 1
            if self.next_post[peer] < self.total_in[peer]:
                self._post_recv(peer)

    def _check(self, peer: int, frame: int, buf: memoryview, nbytes: int) -> None:
        rank = self.link.rank
        if nbytes < HEADER.size:
            raise MismatchError(f"rank {rank}: a {nbytes}-byte message from rank {peer} has no JACCL header "
                                f"(while running {self.request.describe()})")
        kind, reduce, dtype, phase, seq, index, extra, total = HEADER.unpack_from(buf, 0)
        e = self.expect
        if (kind, reduce, dtype, total, extra, phase) != (e.kind, e.reduce, e.dtype, e.nbytes, e.extra, self.phase):
            theirs = Request(kind, reduce, dtype, total, extra)
            steps = "" if phase == self.phase else f" (at step {self.phase}; rank {peer} at step {phase})"
            raise MismatchError(
                f"mismatched operations on rank {rank} and rank {peer}: rank {rank} called "
                f"{self.request.describe()}, rank {peer} called {theirs.describe()}{steps} "
                f"[message #{seq} from rank {peer}]")
        expected_seq = self.seq_in[peer] & 0xFFFFFFFF
        want = min(self.link.payload, max(0, self.recvs[peer] - frame * self.link.payload))
        if seq != expected_seq or index != frame or nbytes - HEADER.size != want:
            raise MismatchError(
                f"rank {rank}: out-of-step message from rank {peer} during {self.request.describe()}: got "
                f"message #{seq} frame {index} with {nbytes - HEADER.size} bytes, expected message "
                f"#{expected_seq} frame {frame} with {want} bytes")


class _OneFrame(_Transfer):
    """The latency path: every message fits one frame, so there is no pipeline to manage."""

    def __init__(self, link: Link, request: Request, expect: Request, phase: int,
                 sends: dict[int, memoryview], recvs: dict[int, int],
                 deliver: Callable[[int, int, memoryview], None], deadline: float) -> None:
        self.link = link
        self.t = link.t
        self.request = request
        self.expect = expect
        self.phase = phase
        self.sends = sends
        self.recvs = recvs
        self.deliver = deliver
        self.deadline = deadline
        self.seq_in = link.received

    def run(self) -> None:
        t, link, r, phase = self.t, self.link, self.request, self.phase
        for p in self.recvs:
            t.post_recv(p, 0)
        for p, data in self.sends.items():
            buf = t.send_buffer(p, 0)
            HEADER.pack_into(buf, 0, r.kind, r.reduce, r.dtype, phase, link.sent[p] & 0xFFFFFFFF, 0, r.extra,
                             r.nbytes)
            n = len(data)
            if n:
                buf[HEADER.size:HEADER.size + n] = data
            t.post_send(p, 0, HEADER.size + n)
        sends_left, recvs_left = len(self.sends), len(self.recvs)
        while sends_left or recvs_left:
            for c in t.poll(self.deadline):
                if c.kind == SEND:
                    sends_left -= 1
                    continue
                buf = t.recv_buffer(c.peer, 0)
                self._check(c.peer, 0, buf, c.nbytes)
                want = self.recvs[c.peer]
                if want:
                    self.deliver(c.peer, 0, buf[HEADER.size:HEADER.size + want])
                recvs_left -= 1
        for p in self.sends:
            link.sent[p] += 1
        for p in self.recvs:
            link.received[p] += 1
