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
import time

import numpy as np

from ...errors import (
    DEADLINE,
    NO_FAILURE,
    CollectiveTimeout,
    DistributedError,
    MismatchError,
    PeerError,
    blaming,
    failure_of,
    with_failure,
)
from ..base import GroupFailure, ReduceOp
from ..protocol import CHECKSUM, Request, checksum, checksum_error, mismatch_message
from ..transport.blame import RELAY_WAIT_S, STUCK_WAIT_S, silence_text, silent_rank
from ..transport.slots import SEND, Transport
from .frame_header import (
    HEADER,
    HEADER_BYTES,
    OWN_MASK,
    SEQ_MASK,
    STAGE_BIT,
    VERIFY_FLAG,
    staged_request,
)
from .transfers import ReduceTransfer, Relay, Transfer

log = logging.getLogger("jacklring.jaccl")


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
        self.payload = transport.frame_bytes - HEADER_BYTES - self.trailer
        self.op_seq = 0        # operations started on this group by this rank (the backend counts)
        self.stalled_op = -1  # the operation whose stall was already reported
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
            self._guarded(request, Transfer(self, request, expect or request, phase, sends, targets, deadline).run)

    def relay(self, request: Request, source: int, sink: int, buf: memoryview, deadline: float) -> None:
        """Receive buf from source and send it on to sink, each frame as soon as it has landed
        (a broadcast chain). Each side also gets a header-only message, so both see a mismatch."""
        if self.failure.why is not None:
            self.failure.check()
        self.t.read_ahead(False)
        self._guarded(request, Relay(self, request, source, sink, buf, deadline).run)

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
        self._guarded(request, ReduceTransfer(self, request, phase, sends, own, out, op, deadline, order).run)

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
            # The link's record, in this operation (with `earlier`, the peer is no culprit: none).
            raise with_failure(wrapped, failure_of(exc) if earlier is None else NO_FAILURE, operation=request.describe(),
                               sequence=self.op_seq) from None
        except BaseException as exc:
            self.failure.mark(f"{type(exc).__name__}: {exc}")
            if isinstance(exc, DistributedError) and failure_of(exc).sequence is None:
                with_failure(exc, operation=request.describe(), sequence=self.op_seq)
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
                if t.post_recv_into(p, 0, HEADER_BYTES, target):
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
                buf[HEADER_BYTES:HEADER_BYTES + n] = data
            n += HEADER_BYTES
            if verify:
                CHECKSUM.pack_into(buf, n, checksum(buf[:n]))
                n += CHECKSUM.size
            t.post_send(p, 0, n)
            sent[p] += 1
        sending = list(sends)
        waiting = list(targets)
        wake = self.first_wake(deadline)
        while sending or waiting:
            try:
                done = t.poll(wake)
            except CollectiveTimeout:
                wake = self.late(request, deadline, self._pending_messages(sending, waiting),
                                  waited=waiting or sending)
                continue
            for c_kind, peer, _slot, nbytes in done:
                if c_kind == SEND:
                    sending.remove(peer)
                    continue
                buf = t.recv_buffer(peer, 0)
                target = targets[peer]
                want = len(target)
                self.check_frame(request, expect, phase, peer, 0, buf, nbytes, want)
                if want and not (direct and peer in direct):
                    target[:] = buf[HEADER_BYTES:HEADER_BYTES + want]
                received[peer] += 1
                waiting.remove(peer)

    def _pending_messages(self, sending: list[int], waiting: list[int]) -> str:
        parts = [f"1 message(s) from {self.t.peer_label(p)}, its message #{self.received[p]} to rank {self.rank}"
                 for p in waiting]
        parts += [f"{self.t.peer_label(p)} to take 1 message(s)" for p in sending]
        return ", ".join(parts) or "nothing"

    # ---- deadlines and stall reports -------------------------------------------------------

    def first_wake(self, deadline: float) -> float:
        """When poll should first give up: the stall-report moment (once per operation), else
        the deadline."""
        if self.stall_report_s is None or self.stalled_op == self.op_seq:
            return deadline
        return deadline - self.timeout + self.stall_report_s

    def late(self, request: Request, deadline: float, pending: str, rate: float = 0.0,
              waited=()) -> float:
        """poll gave up: at the deadline (no frame moved for the timeout) raise naming the
        operation and the peers; before it, report once, "slow, N MB/s" when frames still move
        (rate, bytes/s so far), else "stalled", and return the deadline as the next wake-up."""
        now = time.monotonic()
        if now >= deadline:
            timeout = CollectiveTimeout(f"rank {self.rank}: {request.label(self.op_seq)} timed out: "
                                        f"waiting for {pending} (nothing moved for {self.timeout:g} s)")
            raise self._silent_rank(timeout, list(waited)) from None
        if self.stalled_op != self.op_seq:
            self.stalled_op = self.op_seq
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
                failure = failure_of(exc)
                culprit = failure.culprit
                if culprit is not None and culprit != self.rank:
                    return _named(timeout, culprit, f"{exc}", peer=failure.peer)
                return blaming(timeout, waited[0])

    # ---- checks ------------------------------------------------------------------------------

    def check_frame(self, request: Request, expect: Request, phase: int, peer: int, frame: int, buf: memoryview,
               nbytes: int, want: int) -> None:
        """Raise unless buf[:nbytes] is frame `frame` of the expected message from peer, carrying
        `want` data bytes (and a matching checksum when verifying)."""
        if nbytes >= HEADER_BYTES:
            kind, reduce, dtype, their_phase, seq, index, extra, total = HEADER.unpack_from(buf, 0)
            if (kind == expect.op | self.flag and reduce == expect.reduce and dtype == expect.dtype
                    and their_phase == phase and extra == expect.extra | self.stage and total == expect.nbytes
                    and seq == self.received[peer] & SEQ_MASK and index == frame
                    and nbytes == HEADER_BYTES + want + self.trailer
                    and (not self.verify or CHECKSUM.unpack_from(buf, nbytes - CHECKSUM.size)[0]
                         == checksum(buf[:nbytes - CHECKSUM.size]))):
                return
        self._explain(request, expect, phase, peer, frame, buf, nbytes, want)

    def _explain(self, request: Request, expect: Request, phase: int, peer: int, frame: int, buf: memoryview,
                 nbytes: int, want: int) -> None:
        """The slow path of _check: work out what is wrong and raise it."""
        rank, who = self.rank, self.t.peer_label(peer)
        if nbytes < HEADER_BYTES:
            raise MismatchError(f"rank {rank}: a {nbytes}-byte message from {who} has no JACCL header "
                                f"(while running {request.describe()})")
        kind, reduce, dtype, their_phase, seq, index, extra, total = HEADER.unpack_from(buf, 0)
        if (kind & VERIFY_FLAG) != self.flag:
            mine, theirs = ("on", "off") if self.verify else ("off", "on")
            raise MismatchError(f"rank {rank} has JACKLRING_VERIFY {mine} but {who} has it {theirs}: "
                                "set it alike on every rank")
        if self.verify and nbytes >= HEADER_BYTES + CHECKSUM.size:
            (expected,) = CHECKSUM.unpack_from(buf, nbytes - CHECKSUM.size)
            actual = checksum(buf[:nbytes - CHECKSUM.size])
            if actual != expected:
                raise checksum_error(nbytes, who, actual, expected, rank, f" during {request.label(self.op_seq)}")
        kind &= ~VERIFY_FLAG
        e = expect
        if (kind, reduce, dtype, total, extra, their_phase) != (e.op, e.reduce, e.dtype, e.nbytes,
                                                                e.extra | self.stage, phase):
            theirs = Request(kind, reduce, dtype, total, extra & OWN_MASK if extra & STAGE_BIT else extra)
            theirs = staged_request(theirs, extra)
            request = staged_request(Request(request.op, request.reduce, request.dtype, request.nbytes,
                                             request.extra), request.extra | self.stage)
            steps = "" if their_phase == phase else f" (at step {phase}; rank {peer} at step {their_phase})"
            raise MismatchError(mismatch_message(rank, peer, request, theirs,
                                                 f"{steps} [message #{seq} from rank {peer}]"))
        expected_seq = self.received[peer] & SEQ_MASK
        raise MismatchError(
            f"rank {rank}: out-of-step message from rank {peer} during {request.describe()}: got "
            f"message #{seq} frame {index} with {nbytes - HEADER_BYTES - self.trailer} bytes, expected message "
            f"#{expected_seq} frame {frame} with {want} bytes")


def _named(timeout: CollectiveTimeout, culprit: int, why: str, peer: int | None = None) -> CollectiveTimeout:
    named = CollectiveTimeout(f"{timeout}; {why}")
    return with_failure(named, culprit=culprit, peer=culprit if peer is None else peer,  # type: ignore[return-value]
                        how=DEADLINE)
