"""Standby notice connections: a "stuck too" or a verdict that costs no handshake at a deadline.

After a deadline (origin.py) a rank has STUCK_WAIT_S to hear the ranks it waited for say that
they are stuck too, and a relayed verdict must arrive within RELAY_WAIT_S. A notice of its own
(origin._send_notices) is a connection with an authenticated handshake, made at that moment,
when every rank of the ring is doing the same: on a loaded host it arrived after the window
closed, and a live rank was named (the stop / p2p / 4 ranks / TCP cell of the blame matrix).

So a rank that exchanges point-to-point messages with another opens, in the background and
long before any deadline, one standby connection to it (purpose PURPOSE_STANDBY, the usual
authenticated handshake): the partner's listener hands it over, and the partner keeps it to
write its word on. At a deadline a rank writes its culprit code (origin's codes: -1 stuck
too, a rank, a mismatch) on every standby connection made to it, at once and without waiting
(a few bytes on an open socket), and reads the words of the ranks it waited for from the
connections it made to them. A frame is MACed with a key derived from the job key and the
connection's handshake nonces, numbered per connection (no replay or reorder).

The handshake notices are still sent: a standby connection that was not made in time (a rank
stopped before it answered) changes nothing. A rank stopped before it answered the standby
handshake is not asked again: it is silent either way.
"""
from __future__ import annotations

import hmac
import socket
import struct
import threading
import time

from ...errors import PeerError
from ..transport import tcp
from .state import RingState

PURPOSE_STANDBY = 7  # 1-6: the ring's connections, aborts, origin's notices, shrink, grow
OPEN_S = 2.0         # how long opening a standby connection may take (on a thread of its own)
CLOSE_WAIT_S = 0.5   # close() waits this long, at most, for the openings still under way
FRAME = struct.Struct("<4sIi")  # magic, number of the frame on its connection, culprit code
MAGIC = b"JRSB"
TAG_BYTES = 16


def admits(sender: int, receiver: int, size: int) -> bool:
    return 0 <= sender < size and sender != receiver


class _Link:
    """One standby connection: the socket, its MAC key, its frame counter, what it buffered."""

    __slots__ = ("sock", "key", "count", "pending")

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self.sock, self.key, self.count, self.pending = sock, key, 0, b""


class Standby:
    """The standby connections of one ring group (made by point-to-point, read by origin)."""

    def __init__(self, state: RingState) -> None:
        self._state = state
        self._lock = threading.Lock()
        self._watching: dict[int, _Link] = {}  # q -> the connection this rank made to q (q writes)
        self._watched: dict[int, _Link] = {}   # q -> the connection q made to this rank (this rank writes)
        self._words: dict[int, list[int]] = {}  # q -> codes read from q, not yet consumed
        self._closed = False
        self._openers: dict[int, threading.Thread] = {}  # q -> the thread making (or that made) it

    def _key(self, session: bytes, writer: int, reader: int) -> bytes:
        state = self._state
        return state.auth.derive(f"standby {writer}->{reader}\0".encode() + session).key

    # ---- made early: the first point-to-point exchange with q ----

    def watch(self, q: int) -> None:
        """Make a standby connection to q on a thread (once per q; nothing when it fails)."""
        state = self._state
        if q == state.rank or not state.listeners:
            return
        with self._lock:
            if self._closed or q in self._openers:
                return
            opener = threading.Thread(target=self._open, args=(q,), daemon=True, name=f"jacklring-standby-{q}")
            self._openers[q] = opener
        opener.start()

    def _open(self, q: int) -> None:
        state = self._state
        hello = tcp.Hello(PURPOSE_STANDBY, state.rank, q, 0, state.token)

        def other_job() -> None:  # another incarnation listens there: q has left this group
            raise PeerError(f"rank {q} has left")
        try:
            sock, done = tcp.connect_with_hello(tcp.parse_address(state.addresses[q][0]), hello,
                                                time.monotonic() + OPEN_S, f"rank {q}", state.auth, retry=False,
                                                other_job=other_job)
        except Exception:
            return  # gone, stopped or busy: the handshake notices still apply
        sock.setblocking(False)
        link = _Link(sock, self._key(done.session, q, state.rank))
        with self._lock:
            if not self._closed:
                self._watching[q] = link
                return
        sock.close()

    # ---- at a deadline ----

    def _collect(self) -> None:
        """Take the standby connections other ranks made to this one from the listener."""
        state = self._state
        if not state.listeners:
            return
        listener = state.listeners[0]
        now = time.monotonic()
        while (taken := listener.take(lambda h: h.purpose == PURPOSE_STANDBY, now, None)) is not None:
            sock, hello = taken
            sock.setblocking(False)
            link = _Link(sock, self._key(hello.session, state.rank, hello.sender))
            with self._lock:
                old = None if self._closed else self._watched.get(hello.sender)
                if self._closed:
                    sock.close()
                    continue
                self._watched[hello.sender] = link
            if old is not None:
                old.sock.close()

    def say(self, code: int, to: set[int] | None = None) -> set[int]:
        """Write `code` to the ranks in `to` (default: all) that made a standby connection to this
        rank; never blocks. Returns the ranks whose connection took the whole frame."""
        self._collect()
        with self._lock:
            links = [(q, link) for q, link in self._watched.items() if to is None or q in to]
        told = set()
        for q, link in links:
            frame = FRAME.pack(MAGIC, link.count, code)
            link.count += 1
            data = frame + hmac.new(link.key, frame, "sha256").digest()[:TAG_BYTES]
            try:
                if link.sock.send(data, socket.MSG_DONTWAIT) == len(data):
                    told.add(q)
            except OSError:
                pass
        return told

    def words(self, ranks) -> list[tuple[int, int]]:
        """The codes the ranks in `ranks` wrote on the standby connections this rank made to them
        (consumed), in the order each wrote them; never blocks."""
        size = FRAME.size + TAG_BYTES
        with self._lock:
            links = [(q, self._watching.get(q)) for q in ranks]
        out = []
        for q, link in links:
            if link is None:
                continue
            try:
                while True:
                    data = link.sock.recv(4096)
                    if not data:
                        break
                    link.pending += data
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                pass
            codes = self._words.setdefault(q, [])
            while len(link.pending) >= size:
                frame, tag, link.pending = link.pending[:FRAME.size], link.pending[FRAME.size:size], link.pending[size:]
                magic, number, code = FRAME.unpack(frame)
                if (magic != MAGIC or number != link.count
                        or not hmac.compare_digest(tag, hmac.new(link.key, frame, "sha256").digest()[:TAG_BYTES])):
                    link.pending = b""  # not a word of q's: ignore the rest of this connection
                    break
                link.count += 1
                codes.append(code)
            out += [(q, code) for code in codes]
            codes.clear()
        return out

    def settle(self, q: int, until: float) -> None:
        """Wait, until `until` at most, for the opening of the standby connection to q if it is
        still under way. q's side of the handshake ends first: q may already have written its
        word on a connection that this rank's opener has not filed yet, and then leave, so a
        reader that gave up now would find no word and take q for dead."""
        with self._lock:
            opener = self._openers.get(q)
        if opener is not None and opener is not threading.current_thread():
            opener.join(max(0.0, until - time.monotonic()))

    def close(self) -> None:
        """Close every standby connection; wait (CLOSE_WAIT_S at most) for the openings still
        under way, so a closed group leaves no thread or socket behind."""
        with self._lock:
            self._closed = True
            openers, self._openers = list(self._openers.values()), {}
        until = time.monotonic() + CLOSE_WAIT_S
        for opener in openers:
            if opener is not threading.current_thread():
                opener.join(max(0.0, until - time.monotonic()))
        with self._lock:
            links = list(self._watching.values()) + list(self._watched.values())
            self._watching.clear()
            self._watched.clear()
        for link in links:
            link.sock.close()
