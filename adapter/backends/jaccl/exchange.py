"""Framed, checked, pipelined message exchange over a JACCL transport.

Every message an algorithm sends is cut into frames that fit one transport slot; every frame
starts with a header naming the request it belongs to (operation, reduction, dtype, byte
count, root), the message's sequence number on that link and the frame's index. The receiver
compares each frame's header with what it expects, so two ranks that issued different
operations both raise MismatchError naming both requests instead of corrupting data or hanging.

With JACKLRING_VERIFY=1 every frame also ends with the CRC-32C (protocol.checksum) of its header and data,
checked on receipt (IntegrityError naming the peer); a flag in the header tells a rank whose
peer disagrees about verification. A transfer waiting longer than JACKLRING_STALL_REPORT logs
once which peers still owe frames; at its deadline it raises CollectiveTimeout naming the
operation and the peers.

`FrameExchange.transfer` moves one message to each of several peers and one from each of several peers at
once; messages that fit one frame take a short path (the latency path), larger ones keep
`slots` frames in flight per peer and direction. `FrameExchange.reduce_transfer` is the same
exchange for a reduction: the received frames are reduced (with this rank's part, in rank
order) straight out of the receive slots into the result, so no whole received message is ever
held and the reduction runs while later frames are still on the wire.
"""
from __future__ import annotations

import logging
import struct
import time

import numpy as np

from ...errors import CollectiveTimeout, MismatchError, PeerError, blaming
from ..base import GroupFailure, ReduceOp
from ..elements import reduce_many
from ..protocol import CHECKSUM, OP_CODES, Request, checksum, checksum_error, mismatch_message
from ..transport.blame import RELAY_WAIT_S, STUCK_WAIT_S, silence_text, silent_rank
from ..transport.slots import SEND, Transport

log = logging.getLogger("jacklring.jaccl")

# kind (| VERIFY_FLAG), reduce op, dtype code, phase, sequence, frame index, extra (root / peer), request bytes
HEADER = struct.Struct("<BBBBIIiQ")
VERIFY_FLAG = 0x80
SEQ_MASK = 0xFFFFFFFF
# On the leaders' mesh of a group spanning hosts (local/staged.py) every frame's extra also
# carries the group's operation (and a broadcast's root), so leaders' collectives that look alike
# but stage different operations of the group mismatch: bit 30 set, the operation from bit 26,
# the root (mod 2**14) from bit 12, the leaders' own extra (a root among the hosts) below.
STAGE_BIT, STAGE_SHIFT, DETAIL_SHIFT = 1 << 30, 26, 12
_DETAIL_MASK, _OWN_MASK = (1 << 14) - 1, (1 << 12) - 1
_REDUCING = (OP_CODES["all_reduce"], OP_CODES["reduce_scatter"])


def stage_tag(op_code: int, detail: int) -> int:
    return STAGE_BIT | op_code << STAGE_SHIFT | (detail & _DETAIL_MASK) << DETAIL_SHIFT if op_code else 0


def staged_request(request: Request, extra: int) -> Request:
    """The request a frame's fields stand for: with a stage tag in extra, the group's operation."""
    if extra < 0 or not extra & STAGE_BIT:
        return request
    op = extra >> STAGE_SHIFT & 0xF
    detail = extra >> DETAIL_SHIFT & _DETAIL_MASK
    return Request(op, request.reduce if op in _REDUCING else 0, request.dtype, request.nbytes,
                   detail if op == OP_CODES["broadcast"] else 0)
_HS = HEADER.size

_EMPTY = memoryview(b"")
RECENT_S = 1.0  # a stall report says "slow" when a frame completed this recently, else "stalled"


class FrameExchange:
    """One rank's view of its connections: a transport plus per-peer message counters."""

    def __init__(self, transport: Transport, timeout: float, verify: bool = False,
                 stall_report_s: float | None = None, failure: GroupFailure | None = None) -> None:
        self.t = transport
        self.rank = transport.rank
        self.verify = verify
        self.flag = VERIFY_FLAG if verify else 0
        self.trailer = CHECKSUM.size if verify else 0
        self._stall_setting = stall_report_s
        self.set_timeout(timeout)
        self.sent = {p: 0 for p in transport.peers}
        self.received = {p: 0 for p in transport.peers}
        # The group's failure state (the backend's, shared): the first error makes it unusable.
        self.failure = failure if failure is not None else GroupFailure(f"rank {transport.rank}: this JACCL group")
        self.payload = transport.frame_bytes - _HS - self.trailer
        self.op_seq = 0        # operations started on this group by this rank (the backend counts)
        self._stalled_op = -1  # the operation whose stall was already reported
        self.stage = 0         # stage_tag of the group's collective, on a leaders' mesh

    def set_timeout(self, timeout: float) -> None:
        self.timeout = timeout
        # A stall is reported only when the report comes before the deadline.
        stall = self._stall_setting
        self.stall_report_s = stall if stall and stall < timeout else None

    def deadline(self) -> float:
        return time.monotonic() + self.timeout

    def check_usable(self) -> None:
        self.failure.check()

    def frames(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.payload))

    def transfer(self, request: Request, sends: dict[int, memoryview], targets: dict[int, memoryview],
                 deadline: float, phase: int = 0, expect: Request | None = None) -> None:
        """Send sends[peer] (bytes) to each peer and receive exactly len(targets[peer]) bytes from
        each peer into targets[peer]. `expect` is the request the senders should have made
        (default: the same as ours)."""
        if self.failure.why is not None:
            self.failure.check()
        # Reading ahead is needed only by a rank that sends without receiving (see read_ahead).
        self.t.read_ahead(not targets)
        payload = self.payload
        single = True
        for v in sends.values():
            if len(v) > payload:
                single = False
                break
        if single:
            for v in targets.values():
                if len(v) > payload:
                    single = False
                    break
        if single:
            self._guarded(request, self._one_frame, request, expect or request, phase, sends, targets, deadline)
        else:
            self._guarded(request, _Transfer(self, request, expect or request, phase, sends, targets, deadline).run)

    def relay(self, request: Request, source: int, sink: int, buf: memoryview, deadline: float) -> None:
        """Receive buf from source and send it on to sink, each frame as soon as it has landed
        (a broadcast chain). Each side also gets a header-only message, so both see a mismatch."""
        if self.failure.why is not None:
            self.failure.check()
        self.t.read_ahead(False)
        self._guarded(request, _Relay(self, request, source, sink, buf, deadline).run)

    def reduce_transfer(self, request: Request, sends: dict[int, memoryview], own: np.ndarray, out: np.ndarray,
                        op: ReduceOp, deadline: float, phase: int = 0, order: list[int] | None = None) -> None:
        """Send sends[peer] to each peer while receiving from each rank of `order` (default:
        every rank) but this one its part of this rank's block (own.size elements each) and
        reducing it: out = op over the parts in `order`, own being this rank's part. out may
        alias own."""
        if self.failure.why is not None:
            self.failure.check()
        order = list(range(self.t.size)) if order is None else order
        self.t.read_ahead(False)
        self._guarded(request, _ReduceTransfer(self, request, phase, sends, own, out, op, deadline, order).run)

    def _guarded(self, request: Request, run, *args) -> None:
        """Run one exchange; its first error marks the group failed (peer errors gain the operation)."""
        try:
            run(*args)
        except PeerError as exc:
            # Set already: another thread gave the group up while this ran (break_links: a shrink,
            # dist.shrink_group's SHRINK_ABORT), which is why the links ended: say so.
            earlier = self.failure.why
            self.failure.mark(f"{type(exc).__name__}: {exc}")
            notify = getattr(self.t, "notify_failure", None)  # the TCP mesh's in-band notice
            if notify is not None:
                notify(exc)
            wrapped = PeerError(f"rank {self.rank}: {request.label(self.op_seq)}: {exc}"
                                + ("" if earlier is None else f"; {earlier}"))
            for name in ("culprit", "peer", "outer_culprit") if earlier is None else ():  # the peer is no culprit then
                if hasattr(exc, name):
                    setattr(wrapped, name, getattr(exc, name))
            raise wrapped from None
        except BaseException as exc:
            self.failure.mark(f"{type(exc).__name__}: {exc}")
            notify = getattr(self.t, "notify_failure", None)
            if isinstance(exc, CollectiveTimeout) and notify is not None:
                notify(exc)  # whom the deadline blamed, for the peers stuck behind this rank
            raise

    # ---- the latency path: every message fits one frame -----------------------------------

    def _one_frame(self, request: Request, expect: Request, phase: int, sends: dict[int, memoryview],
                   targets: dict[int, memoryview], deadline: float) -> None:
        t = self.t
        sent, received = self.sent, self.received
        direct = None   # peers whose data the transport puts straight into the target
        if self.verify:
            for p in targets:
                t.post_recv(p, 0)
        else:
            for p, target in targets.items():
                if t.post_recv_into(p, 0, _HS, target):
                    direct = direct or set()
                    direct.add(p)
        kind, reduce, dtype, extra, total = request.op | self.flag, request.reduce, request.dtype, \
            request.extra | self.stage, request.nbytes
        pack_into, verify = HEADER.pack_into, self.verify
        for p, data in sends.items():
            buf = t.send_buffer(p, 0)
            pack_into(buf, 0, kind, reduce, dtype, phase, sent[p] & SEQ_MASK, 0, extra, total)
            n = len(data)
            if n:
                buf[_HS:_HS + n] = data
            n += _HS
            if verify:
                CHECKSUM.pack_into(buf, n, checksum(buf[:n]))
                n += CHECKSUM.size
            t.post_send(p, 0, n)
            sent[p] += 1
        sending = list(sends)
        waiting = list(targets)
        wake = self._first_wake(deadline)
        while sending or waiting:
            try:
                done = t.poll(wake)
            except CollectiveTimeout:
                wake = self._late(request, deadline, self._pending_messages(sending, waiting),
                                  waited=waiting or sending)
                continue
            for c_kind, peer, _slot, nbytes in done:
                if c_kind == SEND:
                    sending.remove(peer)
                    continue
                buf = t.recv_buffer(peer, 0)
                target = targets[peer]
                want = len(target)
                self._check(request, expect, phase, peer, 0, buf, nbytes, want)
                if want and not (direct and peer in direct):
                    target[:] = buf[_HS:_HS + want]
                received[peer] += 1
                waiting.remove(peer)

    def _pending_messages(self, sending: list[int], waiting: list[int]) -> str:
        parts = [f"1 message(s) from {self.t.peer_label(p)}, its message #{self.received[p]} to rank {self.rank}"
                 for p in waiting]
        parts += [f"{self.t.peer_label(p)} to take 1 message(s)" for p in sending]
        return ", ".join(parts) or "nothing"

    # ---- deadlines and stall reports -------------------------------------------------------

    def _first_wake(self, deadline: float) -> float:
        """When poll should first give up: the stall-report moment (once per operation), else
        the deadline."""
        if self.stall_report_s is None or self._stalled_op == self.op_seq:
            return deadline
        return deadline - self.timeout + self.stall_report_s

    def _late(self, request: Request, deadline: float, pending: str, rate: float = 0.0,
              waited=()) -> float:
        """poll gave up: at the deadline (no frame moved for the timeout) raise naming the
        operation and the peers; before it, report once, "slow, N MB/s" when frames still move
        (rate, bytes/s so far), else "stalled", and return the deadline as the next wake-up."""
        now = time.monotonic()
        if now >= deadline:
            timeout = CollectiveTimeout(f"rank {self.rank}: {request.label(self.op_seq)} timed out: "
                                        f"waiting for {pending} (nothing moved for {self.timeout:g} s)")
            raise self._silent_rank(timeout, list(waited)) from None
        if self._stalled_op != self.op_seq:
            self._stalled_op = self.op_seq
            pace = f"slow, {rate / 1e6:.2f} MB/s" if rate > 0 else "stalled"
            log.warning("rank %d: %s is %s (deadline in %.1f s unless more arrives): waiting for %s",
                        self.rank, request.label(self.op_seq), pace, deadline - now, pending)
        return deadline

    def _silent_rank(self, timeout: CollectiveTimeout, waited: list[int]) -> CollectiveTimeout:
        """The deadline's culprit. On the mesh every rank is linked to every other, so in a
        collective the ranks it waits for are the silent one itself; point to point they may be
        stuck behind it. So (TCP mesh) tell every peer this rank is stuck, listen STUCK_WAIT_S
        for the peers it waits for: one that did not say so is the culprit; when all did, adopt
        whom one of them names (its notify_failure) within RELAY_WAIT_S."""
        notify_stuck = getattr(self.t, "notify_stuck", None)
        if notify_stuck is None or not waited:
            return blaming(timeout, waited[0] if waited else None)
        notify_stuck()
        start = time.monotonic()
        while True:
            now = time.monotonic()
            stuck = self.t.stuck_peers()
            silent = silent_rank(waited, stuck)
            if silent is not None and now >= start + STUCK_WAIT_S:
                return _named(timeout, silent, silence_text(silent, STUCK_WAIT_S))
            if silent is None and now >= start + RELAY_WAIT_S:
                return _named(timeout, waited[0], "every rank it waited for was stuck too, and none named another")
            try:
                self.t.poll(min(now + 0.02, start + RELAY_WAIT_S))
            except CollectiveTimeout:
                pass
            except PeerError as exc:  # a verdict: the notice of whom a stuck peer blames
                culprit = getattr(exc, "culprit", None)
                if culprit is not None and culprit != self.rank:
                    return _named(timeout, culprit, f"{exc}", peer=getattr(exc, "peer", culprit))
                return blaming(timeout, waited[0])

    # ---- checks ------------------------------------------------------------------------------

    def _check(self, request: Request, expect: Request, phase: int, peer: int, frame: int, buf: memoryview,
               nbytes: int, want: int) -> None:
        """Raise unless buf[:nbytes] is frame `frame` of the expected message from peer, carrying
        `want` data bytes (and a matching checksum when verifying)."""
        if nbytes >= _HS:
            kind, reduce, dtype, their_phase, seq, index, extra, total = HEADER.unpack_from(buf, 0)
            if (kind == expect.op | self.flag and reduce == expect.reduce and dtype == expect.dtype
                    and their_phase == phase and extra == expect.extra | self.stage and total == expect.nbytes
                    and seq == self.received[peer] & SEQ_MASK and index == frame
                    and nbytes == _HS + want + self.trailer
                    and (not self.verify or CHECKSUM.unpack_from(buf, nbytes - CHECKSUM.size)[0]
                         == checksum(buf[:nbytes - CHECKSUM.size]))):
                return
        self._explain(request, expect, phase, peer, frame, buf, nbytes, want)

    def _explain(self, request: Request, expect: Request, phase: int, peer: int, frame: int, buf: memoryview,
                 nbytes: int, want: int) -> None:
        """The slow path of _check: work out what is wrong and raise it."""
        rank, who = self.rank, self.t.peer_label(peer)
        if nbytes < _HS:
            raise MismatchError(f"rank {rank}: a {nbytes}-byte message from {who} has no JACCL header "
                                f"(while running {request.describe()})")
        kind, reduce, dtype, their_phase, seq, index, extra, total = HEADER.unpack_from(buf, 0)
        if (kind & VERIFY_FLAG) != self.flag:
            mine, theirs = ("on", "off") if self.verify else ("off", "on")
            raise MismatchError(f"rank {rank} has JACKLRING_VERIFY {mine} but {who} has it {theirs}: "
                                "set it alike on every rank")
        if self.verify and nbytes >= _HS + CHECKSUM.size:
            (expected,) = CHECKSUM.unpack_from(buf, nbytes - CHECKSUM.size)
            actual = checksum(buf[:nbytes - CHECKSUM.size])
            if actual != expected:
                raise checksum_error(nbytes, who, actual, expected, rank, f" during {request.label(self.op_seq)}")
        kind &= ~VERIFY_FLAG
        e = expect
        if (kind, reduce, dtype, total, extra, their_phase) != (e.op, e.reduce, e.dtype, e.nbytes,
                                                                e.extra | self.stage, phase):
            theirs = Request(kind, reduce, dtype, total, extra & _OWN_MASK if extra & STAGE_BIT else extra)
            theirs = staged_request(theirs, extra)
            request = staged_request(Request(request.op, request.reduce, request.dtype, request.nbytes,
                                             request.extra), request.extra | self.stage)
            steps = "" if their_phase == phase else f" (at step {phase}; rank {peer} at step {their_phase})"
            raise MismatchError(mismatch_message(rank, peer, request, theirs,
                                                 f"{steps} [message #{seq} from rank {peer}]"))
        expected_seq = self.received[peer] & SEQ_MASK
        raise MismatchError(
            f"rank {rank}: out-of-step message from rank {peer} during {request.describe()}: got "
            f"message #{seq} frame {index} with {nbytes - _HS - self.trailer} bytes, expected message "
            f"#{expected_seq} frame {frame} with {want} bytes")


class _Transfer:
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
        wake = link._first_wake(self.deadline)
        while self._busy():
            try:
                done = self.t.poll(wake)
            except CollectiveTimeout:
                now = time.monotonic()
                flowing = now - self.deadline + link.timeout < RECENT_S  # a frame completed recently
                wake = link._late(self.request, self.deadline, self._pending(),
                                  moved / (now - started) if flowing else 0.0, self._waited())
                continue
            if done:
                # The deadline measures silence: each completed frame restarts it, so a slow link
                # that keeps delivering is not mistaken for a dead peer.
                self.deadline = time.monotonic() + link.timeout
                wake = min(wake, self.deadline) if link._stalled_op != link.op_seq else self.deadline
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
            if self.t.post_recv_into(peer, slot, _HS, self.targets[peer][start:start + self.payload]):
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
            CHECKSUM.pack_into(buf, _HS, checksum(chunk, checksum(buf[:_HS])))
            self.t.post_send_parts(peer, slot, _HS, chunk, CHECKSUM.size)
        else:
            self.t.post_send_parts(peer, slot, _HS, chunk)
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
            link._check(self.request, self.expect, self.phase, peer, frame, buf, nbytes, want)
            if (peer, slot) in self.direct:
                self.direct.discard((peer, slot))   # the data is already in place
            elif want > 0:
                target[offset:offset + want] = buf[_HS:_HS + want]
            self.next_recv[peer] += 1
            if self.next_post[peer] < self.total_in[peer]:
                self._post_recv(peer)


class _ReduceTransfer(_Transfer):
    """A _Transfer whose received frames are reduced, not stored: frame f of every peer waits
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
                link._check(self.request, self.expect, self.phase, q, frame, buf, ready.pop((q, slot)), want)
                parts.append(np.frombuffer(buf, np.uint8, want, _HS).view(self.dtype))
            if want:
                reduce_many(self.out[lo:hi], parts, self.op)
            self.frame += 1
            for q in self.peers:
                self.next_recv[q] += 1
                if self.next_post[q] < self.total_in[q]:
                    self._post_recv(q)


class _Relay(_Transfer):
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


def _named(timeout: CollectiveTimeout, culprit: int, why: str, peer: int | None = None) -> CollectiveTimeout:
    named = CollectiveTimeout(f"{timeout}; {why}")
    named.culprit, named.peer = culprit, culprit if peer is None else peer  # type: ignore[attr-defined]
    return named
