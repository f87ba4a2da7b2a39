"""Messages of several frames over a FrameExchange (exchange.py): `slots` frames in flight per
peer and direction; a reduction's frames reduced straight out of the receive slots; a relay's
frames passed on as they land (a broadcast chain)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from ...errors import CollectiveTimeout
from ..base import ReduceOp
from ..elements import reduce_many
from ..protocol import CHECKSUM, Request, checksum
from ..transport.slots import SEND
from .frame_header import HEADER, HEADER_BYTES, SEQ_MASK

if TYPE_CHECKING:
    from .exchange import FrameExchange

_EMPTY = memoryview(b"")
RECENT_S = 1.0  # a stall report says "slow" when a frame completed this recently, else "stalled"


class Transfer:
    """Messages of several frames: `slots` frames in flight per peer and direction."""

    def __init__(self, link: FrameExchange, request: Request, expect: Request, phase: int,
                 sends: dict[int, memoryview], targets: dict[int, memoryview], deadline: float,
                 payload: int = 0) -> None:
        self.link = link
        # Data bytes per frame: the slot's room, or less (a reduction cuts whole elements).
        self.payload = payload = payload or link.payload
        self.t = link.t
        self.request = request
        self.expect = expect
        self.phase = phase
        self.sends = {p: memoryview(v).cast("B") for p, v in sends.items()}
        self.targets = targets
        self.deadline = deadline
        self.seq_out = {p: link.sent[p] for p in sends}
        self.next_send = {p: 0 for p in sends}          # next frame index to post
        self.unacked = {p: 0 for p in sends}            # posted send frames not yet completed
        self.total_out = {p: max(1, -(-len(v) // payload)) for p, v in self.sends.items()}
        self.total_in = {p: max(1, -(-len(v) // payload)) for p, v in targets.items()}
        self.next_post = {p: 0 for p in targets}        # next frame index to post a receive for
        self.next_recv = {p: 0 for p in targets}        # next frame index to consume
        self.ready: dict[tuple[int, int], int] = {}     # (peer, slot) -> completed bytes
        # Received data may go straight into the targets (not with checksums: those cover the
        # frame as it lies in the slot); `direct` holds the (peer, slot)s whose data did.
        self.into_targets = not link.verify
        self.direct: set[tuple[int, int]] = set()

    def run(self) -> None:
        slots = self.t.slots
        for p in self.targets:
            while self.next_post[p] < min(slots, self.total_in[p]):
                self._post_recv(p)
        for p in self.sends:
            while self.next_send[p] < min(slots, self.total_out[p]) and self._may_send(p):
                self._post_send(p)
        link = self.link
        started = time.monotonic()
        moved = 0
        wake = link.first_wake(self.deadline)
        while self._busy():
            try:
                done = self.t.poll(wake)
            except CollectiveTimeout:
                now = time.monotonic()
                flowing = now - self.deadline + link.timeout < RECENT_S  # a frame completed recently
                wake = link.late(self.request, self.deadline, self._pending(),
                                  moved / (now - started) if flowing else 0.0, self._waited())
                continue
            if done:
                # The deadline measures silence: each completed frame restarts it, so a slow link
                # that keeps delivering is not mistaken for a dead peer.
                self.deadline = time.monotonic() + link.timeout
                wake = min(wake, self.deadline) if link.stalled_op != link.op_seq else self.deadline
            for c in done:
                moved += c.nbytes
                if c.kind == SEND:
                    self.unacked[c.peer] -= 1
                    if self.next_send[c.peer] < self.total_out[c.peer] and self._may_send(c.peer):
                        self._post_send(c.peer)
                else:
                    self.ready[(c.peer, c.slot)] = c.nbytes
                    self._consume(c.peer)
        for p in self.sends:
            link.sent[p] += 1
        for p in self.targets:
            link.received[p] += 1

    def _may_send(self, peer: int) -> bool:
        """Whether the next frame to peer holds its data yet (always, but in a relay)."""
        return True

    def _busy(self) -> bool:
        return (any(self.next_recv[p] < self.total_in[p] for p in self.targets)
                or any(self.next_send[p] < self.total_out[p] or self.unacked[p] for p in self.sends))

    def _waited(self) -> list[int]:
        """The peers still owing frames, else those still to take some."""
        return ([p for p in self.targets if self.next_recv[p] < self.total_in[p]]
                or [p for p in self.sends if self.next_send[p] < self.total_out[p] or self.unacked[p]])

    def _pending(self) -> str:
        label = self.t.peer_label
        parts = [f"{self.total_in[p] - self.next_recv[p]} frame(s) from {label(p)}, of its message "
                 f"#{self.link.received[p]} to rank {self.link.rank}"
                 for p in self.targets if self.next_recv[p] < self.total_in[p]]
        parts += [f"{label(p)} to take {self.total_out[p] - self.next_send[p] + self.unacked[p]} frame(s)"
                  f"{self.t.backlog_note(p)}"
                  for p in self.sends if self.next_send[p] < self.total_out[p] or self.unacked[p]]
        return ", ".join(parts) or "nothing"

    def _post_recv(self, peer: int) -> None:
        frame = self.next_post[peer]
        slot = frame % self.t.slots
        if self.into_targets:
            start = frame * self.payload
            if self.t.post_recv_into(peer, slot, HEADER_BYTES, self.targets[peer][start:start + self.payload]):
                self.direct.add((peer, slot))
        else:
            self.t.post_recv(peer, slot)
        self.next_post[peer] += 1

    def _post_send(self, peer: int) -> None:
        link = self.link
        frame = self.next_send[peer]
        slot = frame % self.t.slots
        start = frame * self.payload
        chunk = self.sends[peer][start:start + self.payload]
        buf = self.t.send_buffer(peer, slot)
        r = self.request
        HEADER.pack_into(buf, 0, r.op | link.flag, r.reduce, r.dtype, self.phase, self.seq_out[peer] & SEQ_MASK,
                         frame, r.extra | link.stage, r.nbytes)
        if link.verify:   # the checksum goes in the slot after the header; the message ends with it
            CHECKSUM.pack_into(buf, HEADER_BYTES, checksum(chunk, checksum(buf[:HEADER_BYTES])))
            self.t.post_send_parts(peer, slot, HEADER_BYTES, chunk, CHECKSUM.size)
        else:
            self.t.post_send_parts(peer, slot, HEADER_BYTES, chunk)
        self.next_send[peer] += 1
        self.unacked[peer] += 1

    def _consume(self, peer: int) -> None:
        """Handle this peer's received frames in frame order (slots may complete out of order
        when they travel on different devices)."""
        link = self.link
        slots = self.t.slots
        target = self.targets[peer]
        payload = self.payload
        while self.next_recv[peer] < self.total_in[peer]:
            frame = self.next_recv[peer]
            slot = frame % slots
            nbytes = self.ready.pop((peer, slot), None)
            if nbytes is None:
                return
            buf = self.t.recv_buffer(peer, slot)
            offset = frame * payload
            want = min(payload, max(0, len(target) - offset))
            link.check_frame(self.request, self.expect, self.phase, peer, frame, buf, nbytes, want)
            if (peer, slot) in self.direct:
                self.direct.discard((peer, slot))   # the data is already in place
            elif want > 0:
                target[offset:offset + want] = buf[HEADER_BYTES:HEADER_BYTES + want]
            self.next_recv[peer] += 1
            if self.next_post[peer] < self.total_in[peer]:
                self._post_recv(peer)


class ReduceTransfer(Transfer):
    """A Transfer whose received frames are reduced, not stored: frame f of every peer waits
    in its receive slot until all peers' frame f is in, then op over them and this rank's part
    (in rank order, so every rank computes the same bits) goes straight into out, and the slots
    take the next frames. Memory stays at the slots, whatever the message size."""

    def __init__(self, link: FrameExchange, request: Request, phase: int, sends: dict[int, memoryview],
                 own: np.ndarray, out: np.ndarray, op: ReduceOp, deadline: float, order: list[int]) -> None:
        item = own.itemsize
        # Frames carry whole elements, so each one is reduced on its own.
        payload = max(item, link.payload - link.payload % item)
        peers = [p for p in order if p != link.rank]
        own_bytes = memoryview(own.reshape(-1).view(np.uint8))
        super().__init__(link, request, request, phase, sends, dict.fromkeys(peers, own_bytes), deadline, payload)
        self.peers = peers
        self.own = own
        self.out = out
        self.op = op
        self.into_targets = False   # the targets stand for sizes only: frames are reduced from the slots
        self.order = order
        self.frame = 0   # the next frame to reduce (the same index for every peer)
        # out may be own itself (in place). reduce_many writes out while reading the first two
        # parts, then reads the others: own as a third or later part must be copied first.
        self.own_later = order.index(link.rank) >= 2 and np.may_share_memory(own, out)
        self.dtype = own.dtype

    def _consume(self, peer: int) -> None:
        link, t, payload = self.link, self.t, self.payload
        slots, item, nbytes = t.slots, self.own.itemsize, self.own.nbytes
        ready = self.ready
        while self.frame < self.total_in[peer]:
            frame = self.frame
            slot = frame % slots
            if any((p, slot) not in ready for p in self.peers):
                return
            offset = frame * payload
            want = min(payload, nbytes - offset)
            lo, hi = offset // item, (offset + want) // item
            parts = []
            for q in self.order:
                if q == link.rank:
                    mine = self.own[lo:hi]
                    parts.append(mine.copy() if self.own_later else mine)
                    continue
                buf = t.recv_buffer(q, slot)
                link.check_frame(self.request, self.expect, self.phase, q, frame, buf, ready.pop((q, slot)), want)
                parts.append(np.frombuffer(buf, np.uint8, want, HEADER_BYTES).view(self.dtype))
            if want:
                reduce_many(self.out[lo:hi], parts, self.op)
            self.frame += 1
            for q in self.peers:
                self.next_recv[q] += 1
                if self.next_post[q] < self.total_in[q]:
                    self._post_recv(q)


class Relay(Transfer):
    """Frame f goes on to the sink once frame f from the source is in buf: a message crosses a
    chain of ranks a frame behind the previous hop instead of a whole message behind."""

    def __init__(self, link: FrameExchange, request: Request, source: int, sink: int, buf: memoryview,
                 deadline: float) -> None:
        super().__init__(link, request, request, 0, {source: _EMPTY, sink: buf}, {source: buf, sink: _EMPTY},
                         deadline)
        self.source, self.sink = source, sink

    def _may_send(self, peer: int) -> bool:
        return peer != self.sink or self.next_send[peer] < self.next_recv[self.source]

    def _consume(self, peer: int) -> None:
        super()._consume(peer)
        if peer == self.source:
            sink, slots = self.sink, self.t.slots
            while (self.next_send[sink] < self.total_out[sink] and self.unacked[sink] < slots
                   and self._may_send(sink)):
                self._post_send(sink)
