"""A single-threaded progress engine for byte streams over non-blocking sockets.

Algorithms post sends and receives on Links; run() moves bytes on every link at once,
calling each receive's callback as soon as it completes (a callback may post more sends,
which is how segments are pipelined: reduce one while the next is on the wire). One thread
and no locks: the kernel does the copies, the two cores of a small machine stay busy with
the two processes, and the ordering of each stream is the order of posting.
"""
from __future__ import annotations

import logging
import select
import socket
import time
from collections import deque
from typing import Callable, Iterable

from ...errors import DEADLINE, LINK, CollectiveTimeout, IntegrityError, PeerError, failure_of, with_failure
from .integrity import CRC, Integrity, crc_update

crc_unpack = CRC.unpack

log = logging.getLogger("jacklring.engine")

# A stall report says "slow" when a byte moved this recently (and within the last half of the
# wait so far), else "stalled".
RECENT_S = 1.0
Callback = Callable[[], None]
Truncated = Callable[[int], None]


class Stream:
    """One TCP connection to a peer, with queues of pending sends and receives."""

    __slots__ = ("sock", "fd", "peer", "label", "sendq", "recvq", "recv_got", "bytes_in", "bytes_out", "verify",
                 "tails", "unsealed", "running", "trailer", "received_crc", "received_size")

    def __init__(self, sock: socket.socket, peer: int, label: str, verify: "bool | Integrity | None" = False) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = peer
        self.label = label  # e.g. "rank 1 (127.0.0.1:5001)", used in every error message
        self.sendq: deque[memoryview] = deque()
        self.recvq: deque[tuple[memoryview, Callback | None, Truncated | None]] = deque()
        self.recv_got = 0
        self.bytes_in = 0
        self.bytes_out = 0
        # JACKLRING_VERIFY: every message is followed by its CRC-32C or MAC, checked on receipt.
        # A trailer is computed when its message reaches the head of the send queue, or earlier
        # while the engine would otherwise sleep (not when it is posted: a whole chunk's
        # checksums up front would delay its first byte), and goes out in the same call as the
        # message's last bytes; a relayed message (post_forward) keeps the CRC it arrived with.
        # The receiver feeds each piece to its check as it lands, reads the trailer in the same
        # call as the message's last bytes, and runs the message's callback only once it checks.
        self.verify = Integrity("crc") if verify is True else (verify or None)
        # With a check, one entry per queued message: its trailer, or None until it is sealed.
        self.tails: deque[bytes | None] | None = deque() if self.verify else None
        self.unsealed = 0                          # how many of them are None
        self.running = None                        # the head incoming message's running check
        self.trailer = memoryview(bytearray(self.verify.size)) if self.verify else None
        # CRC-32C and length of the last message received whole and verified (crc mode): a relay
        # passes the value on with the same bytes (post_forward).
        self.received_crc: int | None = None
        self.received_size = 0

    def __new__(cls, sock: socket.socket, peer: int, label: str,
                verify: "bool | Integrity | None" = False) -> "Stream":
        # A checked stream is a CheckedStream, so the unchecked post_send stays as short as it was.
        return object.__new__(CheckedStream if verify and cls is Stream else cls)

    def post_send(self, view: memoryview) -> None:
        """Queue view for sending; it must not change until sent."""
        if len(view):
            self.sendq.append(view)

    def post_forward(self, view: memoryview, source: "Stream") -> None:
        """Queue view, the message that has just arrived whole and verified on `source` (call it
        from that receive's callback). Unchecked, the same as post_send."""
        if len(view):
            self.sendq.append(view)

    def post_recv(self, view: memoryview, on_done: Callback | None = None,
                  on_truncated: Truncated | None = None) -> None:
        """Fill view, then call on_done. If the peer hangs up part-way, on_truncated(bytes_received)
        may raise a more telling error (e.g. a mismatch visible in the header already received)."""
        if not len(view):
            if on_done is not None:
                on_done()
        else:
            self.recvq.append((view, on_done, on_truncated))

    def pending(self) -> bool:
        return bool(self.sendq or self.recvq)

    def describe_pending(self) -> str:
        parts = []
        trailer = self.verify.size if self.verify else 0
        if self.recvq:
            missing = sum(len(entry[0]) + trailer for entry in self.recvq) - self.recv_got
            parts.append(f"{missing} bytes still to receive from {self.label}")
        if self.sendq:
            tail = len(self.tails[0]) if self.tails and self.tails[0] is not None else trailer
            parts.append(f"{sum(len(v) + trailer for v in self.sendq) - trailer + tail} bytes still to send to {self.label}")
        return "; ".join(parts)

    def reset(self) -> None:
        self.sendq.clear()
        self.recvq.clear()
        self.recv_got = 0
        if self.tails is not None:
            self.tails.clear()
        self.unsealed = 0
        self.running = None
        self.received_crc = None

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class CheckedStream(Stream):
    """A Stream with JACKLRING_VERIFY on: each queued message has an entry in tails."""

    __slots__ = ()

    def post_send(self, view: memoryview) -> None:
        """Queue view for sending; it must not change until sent. Sealed later (see _push_checked)."""
        if len(view):
            self.sendq.append(view)
            self.tails.append(None)
            self.unsealed += 1

    def post_forward(self, view: memoryview, source: Stream) -> None:
        """Queue view, the message that has just arrived whole and verified on `source` (call it
        from that receive's callback): with CRCs on both links the checksum it came with goes
        on with it instead of being computed again, so a byte that changes in this rank's memory
        after the check is caught by the next rank. A MAC is sealed afresh (its key is this link's)."""
        if not len(view):
            return
        self.sendq.append(view)
        value = source.received_crc
        if value is not None and source.received_size == len(view) and self.verify.mode == "crc":
            self.tails.append(CRC.pack(value))
        else:
            self.tails.append(None)
            self.unsealed += 1


class Engine:
    """Drives the posted operations of a set of links to completion under a deadline."""

    def __init__(self, links: Iterable[Stream], rank: int) -> None:
        self.links = list(links)
        self.rank = rank
        self._poll = select.poll()
        self._registered: dict[int, int] = {}
        self.stall_report_s: float | None = None
        # Busy-poll this long before sleeping in poll(): waking a sleeping process costs more
        # than a small message's whole trip on many machines (what MPI libraries do too).
        # The owner sets it from tcp.spin_seconds (no spinning when ranks outnumber CPUs).
        self.spin_s = 0.0

    def run(self, deadline: float, what: str) -> None:
        """Progress every link until all their queues are empty; raise on a dead peer, or when no
        byte has moved for as long as `deadline` allowed at the start (the deadline measures
        silence: a slow transfer that keeps moving bytes is not a dead peer)."""
        all_links = self.links
        links = [link for link in all_links if link.sendq or link.recvq]
        started = time.monotonic()
        silence = max(0.0, deadline - started)
        last_move = started
        moved = False
        stall_at = started + self.stall_report_s if self.stall_report_s else None
        spin_until = started + self.spin_s
        bytes_at_start = self._bytes_moved()
        checked = any(link.verify is not None for link in all_links)
        while links:
            progressed = False
            try:
                for link in links:
                    if link.sendq and self._push(link, what):
                        progressed = True
                    if link.recvq and self._pull(link, what):
                        progressed = True
            except PeerError as exc:
                self._drain_others(links, what)
                if failure_of(exc).peer is None:  # which connection failed (the ring names a split's culprit)
                    with_failure(exc, peer=link.peer, how=failure_of(exc).how or LINK)
                raise
            # A callback may have posted work on any link, not only the ones still busy.
            links = [link for link in all_links if link.sendq or link.recvq]
            if progressed or not links:
                moved = True
                continue
            now = time.monotonic()
            if moved:  # time of the first idle look after bytes moved: when the silence began
                last_move, moved = now, False
            if checked and self._seal_ahead(links):
                continue
            if now < spin_until:
                continue
            if now >= last_move + silence:
                timeout = CollectiveTimeout(
                    f"rank {self.rank}: {what} timed out: no byte moved for {silence:.3g} s; "
                    + "; ".join(l.describe_pending() for l in links)
                )
                # The peers it waits for (those it still expects bytes from, else those that
                # do not take its bytes): the ring asks them why (ring/origin.py).
                waited = [l.peer for l in links if l.recvq] or [l.peer for l in links]
                raise with_failure(timeout, how=DEADLINE, waiting_on=tuple(sorted(set(waited))))
            wait = last_move + silence - now
            if stall_at is not None:
                if now >= stall_at:
                    log.warning("rank %d: %s is %s: %s", self.rank, what,
                                self._pace(bytes_at_start, now - started, now - last_move),
                                "; ".join(l.describe_pending() for l in links))
                    stall_at = None
                else:
                    wait = min(wait, stall_at - now)
            self._wait(links, wait)

    def _bytes_moved(self) -> int:
        return sum(link.bytes_in + link.bytes_out for link in self.links)

    def _pace(self, bytes_at_start: int, elapsed: float, quiet: float) -> str:
        """'slow, N MB/s' (the average so far) while bytes still flow, else 'stalled'."""
        moved = self._bytes_moved() - bytes_at_start
        if moved <= 0 or elapsed <= 0 or quiet > min(RECENT_S, elapsed / 2):
            return "stalled"
        return f"slow, {moved / elapsed / 1e6:.2f} MB/s"

    def _drain_others(self, links: list[Stream], what: str) -> None:
        """A peer hung up: first read whatever already arrived on the other links, so that a
        mismatch it reveals (the usual reason a peer gives up) is reported instead."""
        for link in links:
            if link.recvq:
                try:
                    self._pull(link, what)
                except PeerError:
                    pass

    def _wait(self, links: list[Stream], seconds: float) -> None:
        poll = self._poll
        registered = self._registered
        wanted = {}
        for link in links:
            mask = (select.POLLOUT if link.sendq else 0) | (select.POLLIN if link.recvq else 0)
            wanted[link.fd] = mask
        for fd, mask in wanted.items():
            if registered.get(fd) != mask:
                poll.register(fd, mask)
                registered[fd] = mask
        for fd in [fd for fd in registered if fd not in wanted]:
            poll.unregister(fd)
            del registered[fd]
        poll.poll(max(1, int(min(seconds, 60.0) * 1000) + 1))  # the caller re-checks the deadline

    def _push(self, link: Stream, what: str) -> bool:
        if link.verify is not None:
            return self._push_checked(link, what)
        sock_send = link.sock.send
        queue = link.sendq
        progressed = False
        while queue:
            view = queue[0]
            try:
                sent = sock_send(view)
            except BlockingIOError:
                return progressed
            except OSError as exc:
                raise PeerError(f"rank {self.rank}: {what}: sending to {link.label} failed: "
                                f"{exc.strerror or exc}") from None
            progressed = True
            link.bytes_out += sent
            if sent < len(view):
                queue[0] = view[sent:]
                return progressed
            queue.popleft()
        return progressed

    def _pull(self, link: Stream, what: str) -> bool:
        if link.verify is not None:
            return self._pull_checked(link, what)
        recv_into = link.sock.recv_into
        queue = link.recvq
        progressed = False
        while queue:
            view, on_done, on_truncated = queue[0]
            got = link.recv_got
            try:
                n = recv_into(view[got:] if got else view)
            except BlockingIOError:
                return progressed
            except OSError as exc:
                raise PeerError(f"rank {self.rank}: {what}: connection to {link.label} failed: "
                                f"{exc.strerror or exc}") from None
            if n == 0:
                if on_truncated is not None:
                    on_truncated(got)
                raise PeerError(
                    f"rank {self.rank}: {what}: {link.label} closed the connection "
                    f"({len(view) - got} bytes of the current message still expected; the peer died or raised)"
                )
            progressed = True
            link.bytes_in += n
            got += n
            if got < len(view):
                link.recv_got = got
                return progressed
            link.recv_got = 0
            queue.popleft()
            if on_done is not None:
                on_done()
        return progressed

    # ---- JACKLRING_VERIFY: each message followed by its trailer -----------------------------

    def _push_checked(self, link: Stream, what: str) -> bool:
        sock = link.sock
        queue, tails = link.sendq, link.tails
        progressed = False
        while queue:
            view = queue[0]
            tail = tails[0]
            if tail is None:
                tail = tails[0] = link.verify.seal(view)
                link.unsealed -= 1
            try:
                sent = sock.sendmsg((view, tail))
            except BlockingIOError:
                return progressed
            except OSError as exc:
                raise PeerError(f"rank {self.rank}: {what}: sending to {link.label} failed: "
                                f"{exc.strerror or exc}") from None
            progressed = True
            link.bytes_out += sent
            size = len(view)
            if sent < size:
                queue[0] = view[sent:]
                return progressed
            if sent < size + len(tail):
                queue[0] = view[size:]
                tails[0] = tail[sent - size:]
                return progressed
            queue.popleft()
            tails.popleft()
        return progressed

    @staticmethod
    def _seal_ahead(links: list[Stream]) -> bool:
        """Seal one queued message that is not at the head yet: work moved into time the engine
        would spend waiting for a socket. False when there is none."""
        for link in links:
            if link.unsealed:
                # the first unsealed message (a MAC's counter wants them in order)
                tails = link.tails
                for i, tail in enumerate(tails):
                    if tail is None:
                        tails[i] = link.verify.seal(link.sendq[i])
                        link.unsealed -= 1
                        return True
        return False

    def _pull_checked(self, link: Stream, what: str) -> bool:
        recvmsg_into = link.sock.recvmsg_into
        queue = link.recvq
        verify = link.verify
        crc_mode = verify.mode == "crc"
        trailer = link.trailer
        tsize = len(trailer)
        progressed = False
        while queue:
            view, on_done, on_truncated = queue[0]
            got = link.recv_got
            size = len(view)
            data = view[got:] if got < size else view[size:]
            try:
                n = recvmsg_into((data, trailer[max(0, got - size):]))[0]
            except BlockingIOError:
                return progressed
            except OSError as exc:
                raise PeerError(f"rank {self.rank}: {what}: connection to {link.label} failed: "
                                f"{exc.strerror or exc}") from None
            if n == 0:
                if on_truncated is not None:
                    on_truncated(min(got, size))
                missing = (f"{size - got} bytes of the current message and its {tsize}-byte checksum" if got < size
                           else f"{size + tsize - got} bytes of the current message's checksum")
                raise PeerError(f"rank {self.rank}: {what}: {link.label} closed the connection ({missing} still "
                                f"expected; the peer died or raised)")
            progressed = True
            link.bytes_in += n
            if len(data):
                # Checked as it lands, while the bytes are still in cache. crc mode keeps the
                # running value as a plain int (no object per message).
                piece = data[:n] if n < len(data) else data
                if crc_mode:
                    link.running = crc_update(piece, link.running or 0)
                else:
                    running = link.running
                    if running is None:
                        running = link.running = verify.checker()
                    running.update(piece)
            got += n
            if got < size + tsize:
                link.recv_got = got
                return progressed
            link.recv_got = 0
            running, link.running = link.running, None
            queue.popleft()
            if crc_mode:
                if running != crc_unpack(trailer)[0]:
                    self._corrupt(link, what, size, verify.verdict_crc(running, trailer))
                link.received_crc, link.received_size = running, size
            else:
                problem = verify.verdict(running, trailer)
                if problem is not None:
                    self._corrupt(link, what, size, problem)
            if on_done is not None:
                on_done()
        return progressed

    def _corrupt(self, link: Stream, what: str, size: int, problem: str | None) -> None:
        raise IntegrityError(f"rank {self.rank}: {what}: checksum mismatch on a {size}-byte message from "
                             f"{link.label}: {problem}")
