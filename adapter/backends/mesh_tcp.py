"""The TCP mesh transport: JACCL's transport interface over one TCP connection per peer pair.

Used where no RDMA device exists, so the same mesh and ring algorithms run (and are tested)
on any machine. Sockets are non-blocking and progressed by poll(): every posted send and
receive advances whenever its socket is ready, so ranks that all send to each other at once
never deadlock on full kernel buffers. Each message is an 8-byte length and the bytes.
"""
from __future__ import annotations

import json
import os
import select
import socket
import struct
import time
from collections import deque
from typing import Callable

from ..errors import CollectiveTimeout, ConfigError, PeerError
from . import tcp
from .jaccl_transport import RECV, SEND, BufferPool, Completion, Transport

PURPOSE_MESH = 0x4A4D  # "JM"
FRAME_BYTES = 1 << 20
SLOTS = 2
_LEN = struct.Struct("<Q")
_INBUF_BYTES = 64 << 10
_READ = select.POLLIN | select.POLLPRI
_ERR = select.POLLERR | select.POLLHUP | select.POLLNVAL

Exchange = Callable[[bytes], list[bytes]]


def _spin_seconds() -> float:
    """JACKLRING_SPIN_US (default 50): how long poll() busy-waits before sleeping (0: never)."""
    raw = os.environ.get("JACKLRING_SPIN_US", "50")
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"JACKLRING_SPIN_US={raw!r} is not a number of microseconds") from None
    if value < 0:
        raise ConfigError(f"JACKLRING_SPIN_US={raw!r} must not be negative")
    return value * 1e-6


class _Peer:
    """One connection and its queues of posted work, in posting order."""

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.sends: deque[list] = deque()      # [slot, memoryview still to send, total]
        self.recvs: deque[int] = deque()       # slots waiting for the next message
        # Bytes read ahead of the message being parsed: one recv_into usually brings a whole
        # small message (or several), instead of one call for the length and one for the body.
        self.inbuf = bytearray(_INBUF_BYTES)
        self.inview = memoryview(self.inbuf)
        self.in_start = 0
        self.in_end = 0
        self.body_len = -1                     # >= 0: reading a large body straight into its slot
        self.body_got = 0
        self.mask = 0


class TcpMeshTransport(Transport):
    name = "tcp"

    def __init__(self, rank: int, size: int, sockets: dict[int, socket.socket],
                 frame_bytes: int = FRAME_BYTES, slots: int = SLOTS) -> None:
        self.rank = rank
        self.size = size
        self.peers = sorted(sockets)
        self.frame_bytes = frame_bytes
        self.slots = slots
        self._peers = {p: _Peer(p, s) for p, s in sockets.items()}
        self._by_fd = {s.fileno(): self._peers[p] for p, s in sockets.items()}
        for s in sockets.values():
            s.setblocking(False)
        # Buffers carry 8 spare bytes in front so the length prefix and body go out in one send.
        self._pool = BufferPool(frame_bytes, lambda n, key: bytearray(n + _LEN.size))
        self._poller = select.poll()
        self._done: list[Completion] = []
        self._closed = False
        self.spin_s = _spin_seconds()

    def _who(self, peer: int) -> str:
        return f"rank {peer} (JACCL TCP mesh, from rank {self.rank})"

    def send_buffer(self, peer: int, slot: int) -> memoryview:
        return memoryview(self._pool.get(peer, SEND, slot))[_LEN.size:]

    def recv_buffer(self, peer: int, slot: int) -> memoryview:
        return memoryview(self._pool.get(peer, RECV, slot))[_LEN.size:]

    def post_send(self, peer: int, slot: int, nbytes: int) -> None:
        if not 0 <= nbytes <= self.frame_bytes:
            raise ValueError(f"message of {nbytes} bytes does not fit a {self.frame_bytes}-byte slot")
        raw = self._pool.get(peer, SEND, slot)
        _LEN.pack_into(raw, 0, nbytes)
        state = self._peers[peer]
        state.sends.append([slot, memoryview(raw)[:_LEN.size + nbytes], nbytes])
        if len(state.sends) == 1:
            self._progress_send(state)  # small messages usually leave right here
        self._update_interest(state)

    def post_recv(self, peer: int, slot: int) -> None:
        self._pool.get(peer, RECV, slot)
        state = self._peers[peer]
        state.recvs.append(slot)
        # A message may already sit in the read-ahead buffer: the socket will not signal it again.
        while state.recvs and state.body_len < 0 and self._parse(state):
            pass
        self._update_interest(state)

    def poll(self, deadline: float) -> list[Completion]:
        spin_until = time.monotonic() + self.spin_s
        while not self._done:
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                raise CollectiveTimeout(f"rank {self.rank}: timed out waiting for {self._pending_text()}")
            # Busy-poll briefly before sleeping: a sleeping receiver must be woken by the sender,
            # and on a busy machine that wake-up costs more than a small message's whole trip.
            timeout_ms = 0 if now < spin_until else min(remaining, 1.0) * 1000.0
            for fd, mask in self._poller.poll(timeout_ms):
                state = self._by_fd[fd]
                if state.sends:
                    self._progress_send(state)
                if state.recvs:
                    self._progress_recv(state)
                elif mask & _ERR:
                    self._progress_send(state)  # surfaces the socket error naming the peer
                self._update_interest(state)
        done, self._done = self._done, []
        return done

    def _pending_text(self) -> str:
        parts = []
        for p, state in self._peers.items():
            if state.recvs:
                parts.append(f"{len(state.recvs)} message(s) from rank {p}")
            if state.sends:
                parts.append(f"rank {p} to take {len(state.sends)} message(s)")
        return ", ".join(parts) or "nothing"

    def _progress_send(self, state: _Peer) -> None:
        while state.sends:
            item = state.sends[0]
            try:
                sent = state.sock.send(item[1])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                raise PeerError(f"sending to {self._who(state.rank)} failed: {exc.strerror or exc}") from None
            item[1] = item[1][sent:]
            if len(item[1]):
                return
            state.sends.popleft()
            self._done.append(Completion(SEND, state.rank, item[0], item[2]))

    def _progress_recv(self, state: _Peer) -> None:
        """Complete as many posted receives as the bytes available allow, without blocking."""
        recv_into = state.sock.recv_into
        try:
            while state.recvs:
                if state.body_len >= 0:   # a large body goes straight into its slot
                    view = self.recv_buffer(state.rank, state.recvs[0])[state.body_got:state.body_len]
                    n = recv_into(view)
                    self._check_open(state, n)
                    state.body_got += n
                    if state.body_got == state.body_len:
                        self._finish_recv(state, state.body_len)
                        state.body_len = -1
                    continue
                if self._parse(state):
                    continue
                if state.in_start:  # keep the unparsed tail at the front
                    tail = state.in_end - state.in_start
                    state.inbuf[:tail] = state.inview[state.in_start:state.in_end]
                    state.in_start, state.in_end = 0, tail
                n = recv_into(state.inview[state.in_end:])
                self._check_open(state, n)
                state.in_end += n
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            raise PeerError(f"receiving from {self._who(state.rank)} failed: {exc.strerror or exc}") from None

    def _parse(self, state: _Peer) -> bool:
        """Take one message (or the start of a large one) out of the read-ahead buffer."""
        have = state.in_end - state.in_start
        if have < _LEN.size:
            return False
        (length,) = _LEN.unpack_from(state.inbuf, state.in_start)
        if length > self.frame_bytes:
            raise PeerError(f"{self._who(state.rank)} sent a {length}-byte message, larger than the "
                            f"{self.frame_bytes}-byte slot (different jacklring versions?)")
        body = state.in_start + _LEN.size
        if have - _LEN.size >= length:
            self.recv_buffer(state.rank, state.recvs[0])[:length] = state.inview[body:body + length]
            state.in_start = body + length
            if state.in_start == state.in_end:
                state.in_start = state.in_end = 0
            self._finish_recv(state, length)
            return True
        if length <= len(state.inbuf) - _LEN.size:
            return False  # a small message still arriving: read more into the buffer
        got = state.in_end - body
        self.recv_buffer(state.rank, state.recvs[0])[:got] = state.inview[body:state.in_end]
        state.in_start = state.in_end = 0
        state.body_len, state.body_got = length, got
        return True

    def _finish_recv(self, state: _Peer, nbytes: int) -> None:
        self._done.append(Completion(RECV, state.rank, state.recvs.popleft(), nbytes))

    def _check_open(self, state: _Peer, n: int) -> None:
        if n == 0:
            raise PeerError(f"{self._who(state.rank)} closed the connection (the process exited or failed)")

    def _update_interest(self, state: _Peer) -> None:
        mask = (select.POLLOUT if state.sends else 0) | (_READ if state.recvs else 0)
        if mask == state.mask:
            return
        fd = state.sock.fileno()
        if state.mask == 0:
            self._poller.register(fd, mask)
        elif mask == 0:
            self._poller.unregister(fd)
        else:
            self._poller.modify(fd, mask)
        state.mask = mask

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for state in self._peers.values():
            try:
                state.sock.close()
            except OSError:
                pass
        self._pool.clear()


def connect_mesh(rank: int, size: int, peers: list[int], host: str, exchange: Exchange,
                 token: int, deadline: float) -> TcpMeshTransport:
    """Form the TCP mesh: every rank listens, the addresses are all-gathered with `exchange`
    (called exactly once, on every rank), then each rank connects to its lower peers and accepts
    its higher ones. Listening happens before the exchange, so no connect can arrive early."""
    listener = tcp.listen(host, 0)
    try:
        address = tcp.format_address(listener.getsockname()[:2])
        blobs = exchange(json.dumps({"addr": address}).encode())
        addresses = {p: json.loads(blobs[p])["addr"] for p in peers}
        sockets: dict[int, socket.socket] = {}
        try:
            for p in peers:
                if p < rank:
                    hello = tcp.Hello(PURPOSE_MESH, rank, p, 0, token)
                    sockets[p] = tcp.connect(tcp.parse_address(addresses[p], f"rank {p}'s mesh address"),
                                             hello, deadline, f"rank {p} (JACCL TCP mesh)")
            higher = {p for p in peers if p > rank}
            while higher - set(sockets):
                waiting = sorted(higher - set(sockets))
                sock, hello = tcp.accept(
                    listener, deadline,
                    lambda h: (h.purpose == PURPOSE_MESH and h.token == token and h.receiver == rank
                               and h.sender in higher and h.sender not in sockets),
                    f"JACCL ranks {waiting} (TCP mesh, rank {rank})")
                sockets[hello.sender] = sock
        except BaseException:
            for s in sockets.values():
                s.close()
            raise
    finally:
        listener.close()
    return TcpMeshTransport(rank, size, sockets)
