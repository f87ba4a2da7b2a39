"""send/recv between any two ranks of a ring group: a direct connection to the peer's first
address, opened on first use (beyond MLX, whose ring only talks to neighbours).

A send that the peer does not take reads what the peer sends meanwhile into a spill buffer
(JACKLRING_P2P_SPILL_BYTES per peer), so two ranks that send each other large messages before
receiving do not deadlock; recv() consumes the spill before the socket. A recv that waits for a
peer looks whether it is still alive (check_alive), so a death is a PeerError, not a deadline.
"""
from __future__ import annotations

import select
import socket
import threading
import time

import numpy as np

from ... import config
from ...errors import CollectiveTimeout, DistributedError, IntegrityError, MismatchError, PeerError
from ..elements import byte_view, dtype_code
from ..transport import integrity, tcp
from ..transport.spill import CHUNK as SPILL_CHUNK
from ..transport.spill import Spill
from . import origin
from .header import HEADER, HEADER_MAGIC, OP_SEND, PURPOSE_P2P, describe_header
from .standby import Standby
from .state import RingState

__all__ = ["SPILL_CHUNK", "SPILL_POLL_S", "PointToPoint", "check_alive"]

SPILL_POLL_S = 0.05     # how long a blocked send waits before looking for the peer's connection again
GONE_AFTER_S = 1.0      # a member's address refusing connections this long: it has left (tcp.connect_with_hello)


def check_alive(state: RingState, peer: int) -> None:
    """Raise PeerError if peer is gone: its ring link (for a neighbour) reads end-of-file, or
    its listening address refuses connections. Used while waiting for a message from it."""
    gone = f"rank {state.rank}: recv: rank {peer} ({state.addresses[peer][0]}) exited before sending"
    for link in state.right + state.left:
        if link.peer != peer:
            continue
        try:
            if link.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                raise PeerError(gone + " (its ring connection closed)")
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            if not isinstance(exc, PeerError):
                raise PeerError(f"{gone} ({exc.strerror or exc})") from None
            raise
    host, port = tcp.parse_address(state.addresses[peer][0])
    try:
        with socket.create_connection((host, port), timeout=1.0):
            pass  # connected and closed without a word: the listener drops it quietly
    except ConnectionRefusedError:
        raise PeerError(gone + " (nothing listens on its address any more)") from None
    except OSError:
        pass  # unreachable or slow is not proof of death; the deadline still applies


class PointToPoint:
    """The point-to-point streams of one group, their trailers and spill buffers."""

    def __init__(self, state: RingState, small_limit: int) -> None:
        self._state = state
        self._small_limit = small_limit  # up to this, header, payload and trailer go in one send
        size = state.size
        self._integrity: dict[tuple[int, int], integrity.Integrity | None] = {}
        self._out: dict[int, socket.socket] = {}
        self._in: dict[int, socket.socket] = {}
        self._unusable: dict[int, str] = {}  # peer -> why its incoming stream was given up
        # Bytes read ahead from a peer's stream while a send to it was blocked (see _send_bytes),
        # consumed by recv() before the socket; at most JACKLRING_P2P_SPILL_BYTES per peer.
        spill_limit = config.get("JACKLRING_P2P_SPILL_BYTES")
        self._spill = {q: Spill(spill_limit) for q in range(size)}
        self._spill_ended: set[int] = set()
        self._lock = threading.Lock()
        # One message at a time per peer and direction: two threads writing (or reading) one
        # connection at once would interleave their bytes.
        self._send_locks = {q: threading.Lock() for q in range(size)}
        self._recv_locks = {q: threading.Lock() for q in range(size)}
        state.standby = Standby(state)  # a notice at a deadline needs no handshake then (standby.py)
        # The running schedule's partners (scheduled.py): told of a failure even before a
        # connection to them exists, since they may be waiting for this rank.
        self.expected: set[int] = set()

    def send(self, buf: np.ndarray, dst: int) -> None:
        with self._send_locks[dst]:
            try:
                self._send(buf, dst)
            except (PeerError, CollectiveTimeout) as exc:
                named = origin.blame_p2p(self._state, exc, dst, self._partners())  # and tell the others
                if named is exc:
                    raise
                raise named from None

    def recv(self, buf: np.ndarray, src: int) -> None:
        with self._recv_locks[src]:
            try:
                self._recv(buf, src)
            except (PeerError, CollectiveTimeout) as exc:
                named = origin.blame_p2p(self._state, exc, src, self._partners())
                if named is exc:
                    raise
                raise named from None

    def _partners(self) -> set[int]:
        """The ranks this one exchanges messages with: they may be waiting for it."""
        with self._lock:
            return set(self._out) | set(self._in) | self.expected

    def drop_streams(self) -> None:
        """Close the point-to-point connections (not the standby ones, which carry the notices
        after a failure): a partner waiting on one of them in a collective's schedule
        (scheduled.py) sees the end at once instead of its liveness check's next round."""
        with self._lock:
            for sock in list(self._out.values()) + list(self._in.values()):
                sock.close()
            self._out.clear()
            self._in.clear()

    def close(self) -> None:
        with self._lock:
            for sock in list(self._out.values()) + list(self._in.values()):
                sock.close()
            self._out.clear()
            self._in.clear()
        if self._state.standby is not None:
            self._state.standby.close()

    # ---- sending ----------------------------------------------------------------------------

    def _send(self, buf: np.ndarray, dst: int) -> None:
        state = self._state
        state.failure.check()
        deadline = time.monotonic() + state.timeout
        header = HEADER.pack(HEADER_MAGIC, OP_SEND, dtype_code(buf.dtype), 0, buf.nbytes, 0)
        sock = self._out_socket(dst, deadline)
        who = f"rank {state.rank}: send to {state.who(dst)}"
        seal = self._trailer(state.rank, dst)
        trailer = seal.seal(byte_view(buf)) if seal is not None else b""
        if buf.nbytes <= self._small_limit:
            self._send_bytes(sock, memoryview(header + byte_view(buf).tobytes() + trailer), dst, who)
        else:
            self._send_bytes(sock, memoryview(header), dst, who)
            self._send_bytes(sock, byte_view(buf), dst, who)
            self._send_bytes(sock, memoryview(trailer), dst, who)

    def _out_socket(self, dst: int, deadline: float) -> socket.socket:
        state = self._state
        with self._lock:
            sock = self._out.get(dst)
        if sock is None:
            addr = tcp.parse_address(state.addresses[dst][0])
            hello = tcp.Hello(PURPOSE_P2P, state.rank, dst, 0, state.token)
            try:
                sock, hello = tcp.connect_with_hello(addr, hello, deadline, f"rank {dst}", state.auth,
                                                     gone_after=GONE_AFTER_S)
            except PeerError as exc:
                error = PeerError(f"rank {state.rank}: send: {exc}")
                if getattr(exc, "unanswered", False):
                    error.unanswered = True  # type: ignore[attr-defined]  # origin.blame_p2p: silent
                raise error from None
            self._connected(state.rank, dst, hello)
            with self._lock:
                self._out[dst] = sock
        return sock

    def _send_bytes(self, sock: socket.socket, data: memoryview, dst: int, who: str) -> None:
        """Send all of data. While dst takes nothing, read what dst sends to this rank into its
        spill buffer (dst may itself be blocked sending to us: both ranks sending large messages
        before receiving must not deadlock). Fails when nothing moved either way for the timeout."""
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        sock.settimeout(0.0)  # non-blocking: a blocked send reads the peer's stream meanwhile
        silence = self._state.timeout
        last_move = time.monotonic()
        poller: select.poll | None = None
        while len(view):
            try:
                view = view[sock.send(view):]
                continue
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                raise PeerError(f"{who} failed: {exc.strerror or exc}") from None
            if self._spill_from(dst):
                last_move = time.monotonic()
                continue
            now = time.monotonic()
            if now - last_move >= silence:
                raise CollectiveTimeout(f"{who} timed out: it took no byte for {silence:g} s "
                                        f"({len(view)} bytes left; it is not reading)"
                                        + self._spill[dst].full_note(f"rank {dst}"))
            if poller is None:
                poller = select.poll()
                poller.register(sock, select.POLLOUT)
            incoming = self._spill_socket(dst)
            if incoming is not None:
                try:
                    poller.register(incoming, select.POLLIN)
                except (ValueError, OSError):
                    incoming = None
            poller.poll(max(1, int(min(SPILL_POLL_S, silence - (now - last_move)) * 1000)))
            if incoming is not None:
                try:
                    poller.unregister(incoming)
                except (KeyError, ValueError, OSError):
                    pass

    # ---- the spill ----------------------------------------------------------------------------

    def _spill_socket(self, peer: int) -> socket.socket | None:
        """peer's incoming point-to-point connection, accepting it when it waits in the listener;
        None when it is not there yet, at end of stream, or the spill buffer is full."""
        if self._spill[peer].full() or peer in self._spill_ended:
            return None
        state = self._state
        with self._lock:
            sock = self._in.get(peer)
        if sock is None and state.listeners:
            # Already authenticated by the listener's acceptor: take it if it is waiting there.
            taken = state.listeners[0].take(lambda h: h.purpose == PURPOSE_P2P and h.sender == peer,
                                            time.monotonic(), None)
            if taken is not None:
                with self._lock:
                    sock = self._in.setdefault(peer, taken[0])
                if sock is not taken[0]:
                    taken[0].close()
                else:
                    self._connected(peer, state.rank, taken[1])
        return sock

    def _spill_from(self, peer: int) -> bool:
        """Read what peer already sent into its spill buffer; True when bytes were read. Only under
        peer's receive lock (a recv() running in another thread owns the stream meanwhile), and the
        chunk is queued before the lock is released, so the stream's order is kept."""
        sock = self._spill_socket(peer)
        if sock is None:
            return False
        lock = self._recv_locks[peer]
        if not lock.acquire(blocking=False):
            return False
        try:
            spill = self._spill[peer]
            chunk = spill.new_chunk()
            try:
                # Non-blocking: a socket with a timeout would wait for data despite MSG_DONTWAIT
                # (recv() sets its own timeout again).
                sock.settimeout(0.0)
                n = sock.recv_into(chunk, len(chunk))
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                n = 0  # an error, like the end of the stream, is for the next recv() to report
            if n == 0:
                self._spill_ended.add(peer)
                return False
            spill.keep(chunk, n)
            return True
        finally:
            lock.release()

    # ---- receiving ----------------------------------------------------------------------------

    def _recv(self, buf: np.ndarray, src: int) -> None:
        state = self._state
        state.failure.check()
        # Checks that need no bytes come first, so a refused recv leaves the stream untouched.
        mine = HEADER.pack(HEADER_MAGIC, OP_SEND, dtype_code(buf.dtype), 0, buf.nbytes, 0)
        unusable = self._unusable.get(src)
        if unusable is not None:
            raise DistributedError(f"rank {state.rank}: recv from rank {src}: the stream from rank {src} is "
                                   f"unusable after an earlier error ({unusable})")
        deadline = time.monotonic() + state.timeout
        sock = self._in_socket(src, deadline)
        who = f"rank {state.rank}: recv from {state.who(src)}"
        raw = bytearray(HEADER.size)
        self._recv_bytes(sock, memoryview(raw), src, deadline, who)
        if bytes(raw) != mine:
            expected = (f"rank {state.rank}: recv from rank {src} expected "
                        f"{describe_header(mine).replace('send', 'a message', 1)} but rank {src} "
                        f"sent {describe_header(bytes(raw))}")
            raise MismatchError(expected + self._resynchronise(sock, bytes(raw), src, deadline, who, expected))
        self._recv_bytes(sock, byte_view(buf), src, deadline, who)
        check = self._trailer(src, state.rank)
        if check is not None:
            trailer = bytearray(check.size)
            self._recv_bytes(sock, memoryview(trailer), src, deadline, who)
            problem = check.check(byte_view(buf), trailer)
            if problem is not None:
                raise IntegrityError(f"rank {state.rank}: checksum mismatch on a {buf.nbytes}-byte message "
                                     f"from {state.who(src)}: {problem}")

    def _in_socket(self, src: int, deadline: float) -> socket.socket:
        state = self._state
        next_liveness_check = time.monotonic() + 0.2
        while True:
            with self._lock:
                sock = self._in.get(src)
            if sock is not None:
                return sock
            now = time.monotonic()
            if now >= deadline:
                # The peer is alive (checked below) but sent nothing: a deadline, not a death.
                raise CollectiveTimeout(f"rank {state.rank}: recv: no message from rank {src} "
                                        f"({state.addresses[src][0]}) within the {state.timeout:g} s deadline; "
                                        f"it is alive but never connected to send")
            if now >= next_liveness_check:
                check_alive(state, src)
                next_liveness_check = now + 1.0
            taken = state.listeners[0].take(lambda h: h.purpose == PURPOSE_P2P and h.sender == src,
                                            min(deadline, time.monotonic() + 0.2), None)
            if taken is not None:
                self._connected(src, state.rank, taken[1])
                with self._lock:
                    old = self._in.get(src)
                    self._in[src] = taken[0]
                if old is not None:
                    old.close()

    def _recv_bytes(self, sock: socket.socket, view: memoryview, src: int, deadline: float, who: str) -> None:
        """Fill view from src's spill buffer first, then its stream (caller holds src's receive lock).
        The deadline measures silence: each byte that arrives restarts it."""
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        spill = self._spill[src]
        if spill.chunks:
            view = view[spill.take(view):]
        if not len(view):
            return
        self._spill_ended.discard(src)  # the spill is empty: the stream's end may be read again
        tcp.recv_exact(sock, view, deadline, who, silence=self._state.timeout)

    def _resynchronise(self, sock: socket.socket, raw: bytes, src: int, deadline: float, who: str,
                       reason: str) -> str:
        """After a header that is not the expected one: drain the message it announces so the next
        recv starts at the next message, or (a header that announces no message) close the stream
        and mark it unusable. Returns what was done, for the error message."""
        magic, op, _, _, nbytes, _ = HEADER.unpack(raw)
        if magic == HEADER_MAGIC and op == OP_SEND and 0 <= nbytes:
            check = self._trailer(src, self._state.rank)
            remaining = nbytes + (check.size if check is not None else 0)
            if check is not None:
                check.skip()  # the drained message counts, so a MAC's message counter stays in step
            scratch = memoryview(bytearray(min(remaining, 1 << 20) or 1))
            try:
                while remaining:
                    step = min(remaining, len(scratch))
                    self._recv_bytes(sock, scratch[:step], src, deadline, who)
                    remaining -= step
            except DistributedError as exc:
                self._mark_unusable(src, f"{reason}; draining its payload failed: {exc}")
                return f"; draining its payload failed, so the stream from rank {src} is now unusable"
            return f"; its {nbytes}-byte payload was discarded, the next recv from rank {src} reads its next message"
        self._mark_unusable(src, reason)
        return f"; the stream from rank {src} is out of step, so it is now closed and unusable"

    def _mark_unusable(self, src: int, reason: str) -> None:
        with self._lock:
            self._unusable[src] = reason
            sock = self._in.pop(src, None)
        if sock is not None:
            sock.close()

    # ---- trailers -----------------------------------------------------------------------------

    def _trailer(self, sender: int, receiver: int) -> integrity.Integrity | None:
        """The trailer of the point-to-point stream sender -> receiver (one per connection: a
        MAC counts its messages, under a key of that connection alone); set by _connected."""
        return self._integrity.get((sender, receiver)) if self._state.verify else None

    def _connected(self, sender: int, receiver: int, hello: tcp.Hello) -> None:
        """A point-to-point connection sender -> receiver was set up: its own trailers."""
        state = self._state
        if state.standby is not None:
            state.standby.watch(receiver if sender == state.rank else sender)
        if state.verify:
            peer = receiver if sender == state.rank else sender
            self._integrity[(sender, receiver)] = integrity.for_link(
                state.verify, state.auth, state.token, state.rank, peer, f"p2p {sender}->{receiver}", hello.session)
