"""The TCP mesh transport: JACCL's transport interface over one TCP connection per peer pair
(a Unix socket between ranks on one host with JACKLRING_LOCAL_TRANSPORT=unix).

Used where no RDMA device exists, so the same mesh and ring algorithms run (and are tested)
on any machine. Sockets are non-blocking and progressed by poll(): every posted send and
receive advances whenever its socket is ready, so ranks that all send to each other at once
never deadlock on full kernel buffers. Each message is an 8-byte length and the bytes, sent
with one send() call; reads go into a per-peer read-ahead buffer, so one recv_into usually
brings a whole small message (or several).

This is the latency path of the TCP backend, so the per-message work is kept to a few
attribute reads: buffers and their views are made once per slot, completions are tuples, and
each socket stays registered for reading (a message that arrives early is simply read ahead).
"""
from __future__ import annotations

import json
import select
import socket
import struct
import time
from collections import deque
from typing import Any, Callable

from ... import config
from ...errors import CollectiveTimeout, PeerError
from . import tcp
from .blame import relay_error
from .slots import RECV, SEND, BufferPool, Completion, Transport
from .spill import Spill
from .tcp import available_cpus, spin_seconds  # noqa: F401  (shared with the ring)

PURPOSE_MESH = 0x4A4D  # "JM"
PURPOSE_SHRINK = 0x4A53  # "JS": shrink's agreement (membership.py) at a formed mesh's listener
# A length with this bit set is no message but a failing rank's last word: the rest is the
# rank it blames (see notify_failure; the words and the rule are blame.py's, as the ring's).
_NOTICE = 1 << 63
_STUCK = 1 << 62  # a notice of _NOTICE | _STUCK: "this rank timed out too, waiting for another"
# A notice of _NOTICE | _OUTER | q, on a leaders' mesh (local/staged.py): rank q of the whole
# group whose hosts the mesh links failed (see notify_outer).
_OUTER = 1 << 61
FRAME_BYTES = 1 << 20
SLOTS = 2
_LEN = struct.Struct("<Q")
_LS = _LEN.size
_INBUF_BYTES = 64 << 10
_READ = select.POLLIN | select.POLLPRI
# Below this a frame's data is copied into its slot (one send call); above it the slot's header
# and the caller's memory go out together with sendmsg, saving a copy of every byte.
_GATHER_MIN_BYTES = 64 << 10
# With read-ahead off, how long poll waits with nothing moving before reading ahead anyway.
STUCK_READ_AHEAD_S = 0.2
_new = tuple.__new__

Exchange = Callable[[bytes], list[bytes]]


class _Peer:
    """One connection, its slot buffers and its queues of posted work, in posting order."""

    __slots__ = ("rank", "sock", "fd", "label", "sends", "recvs", "inbuf", "inview", "in_start", "in_end",
                 "body_len", "body_got", "mask", "gone", "send_raw", "send_views", "recv_views", "spill",
                 "divert", "body_into", "body_head", "stuck")

    def __init__(self, rank: int, sock: socket.socket, label: str, slots: int, spill_limit: int) -> None:
        self.rank = rank
        self.sock = sock
        self.fd = sock.fileno()
        self.label = label
        self.sends: deque[list] = deque()      # [slot, memoryview (or list of them) still to send, nbytes]
        self.recvs: deque[int] = deque()       # slots waiting for the next message
        self.inbuf = bytearray(_INBUF_BYTES)
        self.inview = memoryview(self.inbuf)
        self.in_start = 0
        self.in_end = 0
        self.body_len = -1                     # >= 0: reading a large body straight into its slot
        self.body_got = 0
        self.mask = 0
        self.gone: str | None = None           # why the connection ended; an error once a message is awaited
        self.stuck = False                     # it said it timed out waiting for another rank
        # Bytes that arrived while nobody waited on this peer and the read-ahead buffer was full
        # (the peer may be blocked sending to us while we send to it); they follow inbuf's bytes.
        self.spill = Spill(spill_limit)
        self.send_raw: list[memoryview | None] = [None] * slots   # length prefix + body
        self.send_views: list[memoryview | None] = [None] * slots  # the body part
        self.recv_views: list[memoryview | None] = [None] * slots
        # Per receive slot, (head, view) from post_recv_into: a message of exactly head +
        # len(view) bytes puts its first head bytes in the slot and the rest straight into view.
        self.divert: list[tuple[int, memoryview] | None] = [None] * slots
        self.body_into: memoryview | None = None   # the large body being read goes there
        self.body_head = 0


class TcpMeshTransport(Transport):
    name = "tcp"

    def __init__(self, rank: int, size: int, sockets: dict[int, socket.socket],
                 frame_bytes: int = FRAME_BYTES, slots: int = SLOTS, labels: dict[int, str] | None = None,
                 spin_s: float | None = None, listener: tcp.Listener | None = None,
                 addresses: list[str] | None = None) -> None:
        self.rank = rank
        self.size = size
        # The listener the mesh formed on, kept open (connect_mesh): shrink's agreement reaches
        # this rank there (PURPOSE_SHRINK), at addresses[rank]; closed with the transport.
        self.listener = listener
        self.addresses = addresses
        self.peers = sorted(sockets)
        self.frame_bytes = frame_bytes
        self.slots = slots
        labels = labels or {}
        self.spill_limit = config.get("JACKLRING_P2P_SPILL_BYTES")
        self._peers: list[_Peer | None] = [None] * size
        for p, s in sockets.items():
            s.setblocking(False)
            self._peers[p] = _Peer(p, s, labels.get(p, f"rank {p} (JACCL TCP mesh)"), slots, self.spill_limit)
        self._by_fd = {state.fd: state for state in self._peers if state is not None}
        # Buffers carry 8 spare bytes in front so the length prefix and body go out in one send.
        self._pool = BufferPool(frame_bytes, lambda n, key: bytearray(n + _LS))
        self._poller = select.poll()
        for state in self._by_fd.values():
            self._set_mask(state, _READ)
        self._done: list[Completion] = []
        self._closed = False
        self.posted_bytes = 0   # message bytes posted for sending (what an algorithm puts on the wire)
        self.spin_s = spin_seconds(size) if spin_s is None else spin_s
        self._spill_allowed = True
        self._paused: list[_Peer] = []   # not read while read-ahead was off; read again when it is on

    def read_ahead(self, allowed: bool) -> None:
        """Whether bytes that no posted receive waits for may be read into the spill. A rank that
        sends without receiving needs it (two ranks that both send large messages before
        receiving); in a collective every byte has a receive coming, and reading ahead would
        hold and copy a peer's later messages (up to JACKLRING_P2P_SPILL_BYTES of memory). When
        it is off, poll still reads ahead once nothing has moved for STUCK_READ_AHEAD_S (a peer
        blocked in a send this rank receives only later)."""
        if allowed == self._spill_allowed:
            return
        self._spill_allowed = allowed
        if allowed:
            for state in self._paused:
                if state.gone is None and not state.mask & select.POLLIN:
                    self._set_mask(state, state.mask | _READ)
            self._paused.clear()

    def peer_label(self, peer: int) -> str:
        state = self._peers[peer] if 0 <= peer < self.size else None
        return state.label if state is not None else f"rank {peer}"

    def backlog_note(self, peer: int) -> str:
        state = self._peers[peer] if 0 <= peer < self.size else None
        if state is None:
            return ""
        # Both ranks sending more than the cap before receiving: each waits for the other.
        return state.spill.full_note(state.label)

    # ---- buffers ---------------------------------------------------------------------------

    def _make_send(self, state: _Peer, slot: int) -> memoryview:
        raw = memoryview(self._pool.get(state.rank, SEND, slot))
        state.send_raw[slot] = raw
        view = state.send_views[slot] = raw[_LS:]
        return view

    def _make_recv(self, state: _Peer, slot: int) -> memoryview:
        view = state.recv_views[slot] = memoryview(self._pool.get(state.rank, RECV, slot))[:self.frame_bytes]
        return view

    def send_buffer(self, peer: int, slot: int) -> memoryview:
        state = self._peers[peer]
        return state.send_views[slot] or self._make_send(state, slot)

    def recv_buffer(self, peer: int, slot: int) -> memoryview:
        state = self._peers[peer]
        return state.recv_views[slot] or self._make_recv(state, slot)

    # ---- posting ---------------------------------------------------------------------------

    def post_send(self, peer: int, slot: int, nbytes: int) -> None:
        if not 0 <= nbytes <= self.frame_bytes:
            raise ValueError(f"message of {nbytes} bytes does not fit a {self.frame_bytes}-byte slot")
        state = self._peers[peer]
        raw = state.send_raw[slot]
        if raw is None:
            self._make_send(state, slot)
            raw = state.send_raw[slot]
        self.posted_bytes += nbytes
        _LEN.pack_into(raw, 0, nbytes)
        view = raw[:_LS + nbytes]
        if not state.sends:  # the usual case: the whole message leaves in this one call
            try:
                sent = state.sock.send(view)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                raise _peer_error(state, f"sending to {state.label} failed: {exc.strerror or exc}") from None
            if sent == len(view):
                self._done.append(_new(Completion, (SEND, peer, slot, nbytes)))
                return
            view = view[sent:]
        state.sends.append([slot, view, nbytes])
        self._set_mask(state, state.mask | select.POLLOUT)

    def post_send_parts(self, peer: int, slot: int, head: int, data: memoryview, tail: int = 0) -> None:
        """slot[:head] + data + slot[head:head + tail], sent from where data lies (no copy)."""
        n = len(data)
        if n < _GATHER_MIN_BYTES:
            super().post_send_parts(peer, slot, head, data, tail)
            return
        nbytes = head + n + tail
        if nbytes > self.frame_bytes:
            raise ValueError(f"message of {nbytes} bytes does not fit a {self.frame_bytes}-byte slot")
        state = self._peers[peer]
        raw = state.send_raw[slot]
        if raw is None:
            self._make_send(state, slot)
            raw = state.send_raw[slot]
        self.posted_bytes += nbytes
        _LEN.pack_into(raw, 0, nbytes)
        parts = [raw[:_LS + head], data]
        if tail:
            parts.append(raw[_LS + head:_LS + head + tail])
        if not state.sends:
            try:
                sent = state.sock.sendmsg(parts)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                raise _peer_error(state, f"sending to {state.label} failed: {exc.strerror or exc}") from None
            parts = _unsent(parts, sent)
            if not parts:
                self._done.append(_new(Completion, (SEND, peer, slot, nbytes)))
                return
        state.sends.append([slot, parts, nbytes])
        self._set_mask(state, state.mask | select.POLLOUT)

    def post_recv_into(self, peer: int, slot: int, head: int, view: memoryview) -> bool:
        """A receive whose data (after head bytes) goes straight into view, saving the copy out of
        the slot, when the message is exactly head + len(view) bytes; any other message fills
        the slot as post_recv does (its checks then fail it). Returns whether view is used."""
        if len(view) < _GATHER_MIN_BYTES or head + len(view) > self.frame_bytes:
            self.post_recv(peer, slot)
            return False
        self._peers[peer].divert[slot] = (head, view)
        self.post_recv(peer, slot)
        return True

    def post_recv(self, peer: int, slot: int) -> None:
        state = self._peers[peer]
        if state.recv_views[slot] is None:
            self._make_recv(state, slot)
        state.recvs.append(slot)
        if state.spill.chunks:
            self._progress_recv(state)  # the message may be in the spill: no poll event will come for it
        if state.in_end > state.in_start:
            # A message may already sit in the read-ahead buffer: the socket will not signal it again.
            while state.recvs and state.body_len < 0 and self._parse(state):
                pass
        if state.recvs:
            if state.gone is not None:
                raise _peer_error(state, state.gone)
            if not state.mask & select.POLLIN:
                self._set_mask(state, state.mask | _READ)

    # ---- progress ----------------------------------------------------------------------------

    def poll(self, deadline: float) -> list[Completion]:
        done = self._done
        if done:
            self._done = []
            return done
        poll, by_fd = self._poller.poll, self._by_fd
        now = time.monotonic()
        spin_until = now + self.spin_s
        stuck_at = now + STUCK_READ_AHEAD_S
        while True:
            remaining = deadline - now
            # Busy-poll briefly before sleeping (see spin_seconds): a sleeping receiver must be
            # woken by the sender, and on an idle machine that costs more than a small message's
            # trip. Past the deadline, one last look without waiting (the process may have been
            # stopped while the data arrived).
            wait_ms = 0 if now < spin_until or remaining <= 0 else (remaining if remaining < 1.0 else 1.0) * 1000.0
            if self._paused and wait_ms:
                # Peers left unread (read_ahead off) and nothing moving: one of them may be blocked
                # sending to us while we wait for something it must do first (a send this rank
                # has not received yet). Read ahead after a while rather than deadlock.
                if now >= stuck_at:
                    self.read_ahead(True)
                    wait_ms = 0
                else:
                    wait_ms = min(wait_ms, (stuck_at - now) * 1000.0)
            for fd, mask in poll(wait_ms):
                state = by_fd[fd]
                if state.sends:
                    self._progress_send(state)
                if mask != select.POLLOUT:
                    self._progress_recv(state)
            done = self._done
            if done:
                self._done = []
                return done
            if remaining <= 0:
                raise CollectiveTimeout(f"rank {self.rank}: timed out waiting for {self._pending_text()}")
            now = time.monotonic()

    def _pending_text(self) -> str:
        parts = []
        for state in self._by_fd.values():
            if state.recvs:
                parts.append(f"{len(state.recvs)} message(s) from {state.label}")
            if state.sends:
                parts.append(f"{state.label} to take {len(state.sends)} message(s)")
        return ", ".join(parts) or "nothing"

    def _progress_send(self, state: _Peer) -> None:
        sends = state.sends
        while sends:
            item = sends[0]
            pending = item[1]
            gather = type(pending) is list
            try:
                sent = state.sock.sendmsg(pending) if gather else state.sock.send(pending)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                raise _peer_error(state, f"sending to {state.label} failed: {exc.strerror or exc}") from None
            item[1] = _unsent(pending, sent) if gather else pending[sent:]
            if len(item[1]):
                return
            sends.popleft()
            self._done.append(_new(Completion, (SEND, state.rank, item[0], item[2])))
        self._set_mask(state, state.mask & ~select.POLLOUT)

    def _progress_recv(self, state: _Peer) -> None:
        """Complete as many posted receives as the bytes available allow and read ahead what
        fits in the buffer, without blocking."""
        recv_into = state.sock.recv_into
        # A read that leaves room in its buffer drained the socket: parse what came and return
        # (poll reports the socket again if more arrives) instead of paying for an EAGAIN.
        drained = False
        try:
            while True:
                if state.body_len >= 0:   # a large body goes straight into its slot (or view)
                    view = self._dest(state, state.recvs[0], state.body_got, state.body_len)
                    if state.spill.chunks:
                        n = state.spill.take(view)
                    else:
                        if drained:
                            return
                        n = recv_into(view)
                        if n == 0:
                            raise _peer_error(state, self._closed_text(state))
                        drained = n < len(view)
                    state.body_got += n
                    if state.body_got == state.body_len:
                        self._finish_recv(state, state.body_len)
                        state.body_len = -1
                    continue
                if state.spill.chunks:
                    self._refill(state)
                if state.recvs and self._parse(state):
                    continue
                if drained:
                    return
                if not state.recvs and self._done:
                    # Hand the completions back first: the caller is about to post the next
                    # receive, and reading ahead now would copy (or spill) a large body twice.
                    return
                if state.in_start:  # keep the unparsed tail at the front
                    tail = state.in_end - state.in_start
                    state.inbuf[:tail] = state.inview[state.in_start:state.in_end]
                    state.in_start, state.in_end = 0, tail
                space = _INBUF_BYTES - state.in_end
                if not space or state.spill.chunks:
                    # Full and nobody waiting on this peer yet: keep reading into the spill, up to
                    # its limit, so a peer blocked sending to us can finish and read our messages
                    # (while the caller allows it: see read_ahead).
                    if state.spill.full() or not (self._spill_allowed or state.recvs):
                        self._set_mask(state, state.mask & ~_READ)
                        if not self._spill_allowed and state not in self._paused:
                            self._paused.append(state)
                        return
                    chunk = state.spill.new_chunk()
                    n = recv_into(chunk)
                    if n == 0:
                        self._connection_ended(state, self._closed_text(state))
                        return
                    state.spill.keep(chunk, n)
                    drained = n < len(chunk)
                    continue
                n = recv_into(state.inview[state.in_end:])
                if n == 0:
                    self._connection_ended(state, self._closed_text(state))
                    return
                state.in_end += n
                drained = n < space
        except (BlockingIOError, InterruptedError):
            return
        except PeerError:  # an OSError too: it already names the peer
            raise
        except OSError as exc:
            self._connection_ended(state, f"receiving from {state.label} failed: {exc.strerror or exc}")

    def _refill(self, state: _Peer) -> None:
        """Move spilled bytes into the read-ahead buffer's free space (they come right after it)."""
        if state.in_start:
            tail = state.in_end - state.in_start
            state.inbuf[:tail] = state.inview[state.in_start:state.in_end]
            state.in_start, state.in_end = 0, tail
        if state.in_end < _INBUF_BYTES:
            state.in_end += state.spill.take(state.inview[state.in_end:])
        if not state.spill.full() and not state.mask & select.POLLIN and state.gone is None:
            self._set_mask(state, state.mask | _READ)

    def _parse(self, state: _Peer) -> bool:
        """Take one message (or the start of a large one) out of the read-ahead buffer."""
        start = state.in_start
        have = state.in_end - start
        if have < _LS:
            return False
        (length,) = _LEN.unpack_from(state.inbuf, start)
        if length == _NOTICE | _STUCK:
            state.stuck = True  # not an end: whom it blames may follow (notify_failure)
            state.in_start += _LS
            return True
        if length & _NOTICE and length & _OUTER:
            outer = length & ~(_NOTICE | _OUTER)
            exc = relay_error("", outer, state.rank, f"{state.label}, naming it by its rank in the group spanning the hosts")
            exc.outer_culprit = outer  # type: ignore[attr-defined]
            del exc.culprit  # no rank of this mesh: nothing to pass on to its other peers
            state.gone = str(exc)
            raise exc
        if length & _NOTICE:
            exc = relay_error("", length & ~_NOTICE, state.rank, state.label)
            state.gone = str(exc)
            raise exc
        if length > self.frame_bytes:
            raise PeerError(f"{state.label} sent a {length}-byte message, larger than the "
                            f"{self.frame_bytes}-byte slot (different jacklring versions?)")
        body = start + _LS
        slot = state.recvs[0]
        if have - _LS >= length:
            state.recvs.popleft()
            if state.divert[slot] is None:
                state.recv_views[slot][:length] = state.inview[body:body + length]
            else:
                self._take_divert(state, slot, length)
                self._place(state, slot, state.inview[body:body + length])
                state.body_into = None
            end = body + length
            if end == state.in_end:
                state.in_start = state.in_end = 0
            else:
                state.in_start = end
            self._done.append(_new(Completion, (RECV, state.rank, slot, length)))
            return True
        if length <= _INBUF_BYTES - _LS:
            return False  # a small message still arriving: read more into the buffer
        got = state.in_end - body
        if state.divert[slot] is not None:
            self._take_divert(state, slot, length)
        self._place(state, slot, state.inview[body:state.in_end])
        state.in_start = state.in_end = 0
        state.body_len, state.body_got = length, got
        return True

    @staticmethod
    def _take_divert(state: _Peer, slot: int, length: int) -> None:
        """The message for this slot has begun: use its diverted view if the length fits it."""
        head, into = state.divert[slot]
        state.divert[slot] = None
        state.body_into, state.body_head = (into, head) if length == head + len(into) else (None, 0)

    @staticmethod
    def _dest(state: _Peer, slot: int, start: int, end: int) -> memoryview:
        """Where the message's bytes [start, end) go: the slot, or past the head the diverted view
        (one of the two: the returned view may be shorter)."""
        into = state.body_into
        if into is None:
            return state.recv_views[slot][start:end]
        head = state.body_head
        if start < head:
            return state.recv_views[slot][start:min(end, head)]
        return into[start - head:end - head]

    def _place(self, state: _Peer, slot: int, data: memoryview) -> None:
        """Copy the first len(data) bytes of a message to where they belong."""
        pos, n = 0, len(data)
        while pos < n:
            dest = self._dest(state, slot, pos, n)
            dest[:] = data[pos:pos + len(dest)]
            pos += len(dest)

    def _finish_recv(self, state: _Peer, nbytes: int) -> None:
        state.body_into = None
        self._done.append(_new(Completion, (RECV, state.rank, state.recvs.popleft(), nbytes)))

    def _connection_ended(self, state: _Peer, why: str) -> None:
        """End of stream or a reset. An error only once a message from this peer is awaited: a
        peer that finished and closed while this rank talks to others is no failure."""
        state.gone = why
        self._set_mask(state, state.mask & ~_READ)
        if state.recvs:
            raise _peer_error(state, why)

    @staticmethod
    def _closed_text(state: _Peer) -> str:
        return f"{state.label} closed the connection (the process exited or failed)"

    def _set_mask(self, state: _Peer, mask: int) -> None:
        if mask == state.mask:
            return
        if state.mask == 0:
            self._poller.register(state.fd, mask)
        elif mask == 0:
            self._poller.unregister(state.fd)
        else:
            self._poller.modify(state.fd, mask)
        state.mask = mask

    def links(self) -> list[tuple[int, str, int]]:
        """(file descriptor, label, peer) of every connection, for a watcher that must notice a
        peer hanging up (shared memory's wait: local/segment.py SharedGroup.watch)."""
        return [(state.fd, state.label, state.rank) for state in self._by_fd.values()]

    def closed_peers(self) -> list[int]:
        """Peers whose connection has ended (end of file or error), without consuming any data."""
        ended = []
        for state in self._by_fd.values():
            if state.gone is not None:
                ended.append(state.rank)
                continue
            try:
                if state.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    ended.append(state.rank)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                ended.append(state.rank)
        return sorted(ended)

    def pending_notices(self) -> dict[int, int]:
        """{peer: the rank it blames} for the peers whose next unread bytes are a failure notice
        (between exchanges, such as while a split forms; nothing is consumed)."""
        found = {}
        for state in self._by_fd.values():
            if state.in_end - state.in_start >= _LS:
                head = bytes(state.inview[state.in_start:state.in_start + _LS])
            else:
                try:
                    head = bytes(state.inview[state.in_start:state.in_end]) + state.sock.recv(
                        _LS - (state.in_end - state.in_start), socket.MSG_PEEK | socket.MSG_DONTWAIT)
                except OSError:
                    continue
            if len(head) == _LS:
                (length,) = _LEN.unpack(head)
                if length & _NOTICE and not length & (_STUCK | _OUTER):
                    found[state.rank] = length & ~_NOTICE
        return found

    def notify_failure(self, exc: BaseException) -> None:
        """Before this rank gives up because a peer's connection failed, tell every other live
        peer whom it blames, so that a peer waiting on this rank names the rank that died rather
        than this one. In band: an 8-byte notice where a message length would come, sent only on
        connections with no message half-sent (the peer then expects a length there), without
        blocking. Best effort: a connection in mid-message just closes as before."""
        culprit = getattr(exc, "culprit", None)
        if culprit is None or not 0 <= culprit < self.size:
            return
        self._notify_live_peers(_LEN.pack(_NOTICE | culprit), skip=(culprit, getattr(exc, "peer", None)))

    def notify_outer(self, culprit: int) -> None:
        """On a leaders' mesh (local/staged.py): tell every live peer, in band as notify_failure,
        that this rank gives up because of rank `culprit` of the whole group (none when < 0)."""
        if culprit >= 0:
            self._notify_live_peers(_LEN.pack(_NOTICE | _OUTER | culprit))

    def notify_stuck(self) -> None:
        """This rank's deadline passed: tell every live peer it is stuck too (in band, as
        notify_failure), so a peer waiting for it does not take it for the silent rank."""
        self._notify_live_peers(_LEN.pack(_NOTICE | _STUCK))

    def _notify_live_peers(self, notice: bytes, skip: tuple = ()) -> None:
        """Send a notice to every peer still connected with nothing queued for it (a notice must
        not land inside a half-sent frame); best effort, never blocking."""
        for state in self._by_fd.values():
            if state.gone is None and not state.sends and state.rank not in skip:
                try:
                    state.sock.send(notice, socket.MSG_DONTWAIT)
                except OSError:
                    pass  # its buffer is full or it is gone: it sees the connection close instead

    def stuck_peers(self) -> set[int]:
        """The peers that said they are stuck too (read while a receive from them is posted)."""
        return {state.rank for state in self._by_fd.values() if state.stuck}

    @property
    def closed(self) -> bool:
        return self._closed

    def break_links(self) -> None:
        """Shut every connection down (the peers, and an operation of this rank's in flight on
        another thread, see them end at once); the sockets close with close(), the listener
        stays open for shrink's agreement."""
        for state in self._by_fd.values():
            try:
                state.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for state in self._by_fd.values():
            try:
                state.sock.close()
            except OSError:
                pass
        self._pool.clear()
        if self.listener is not None:
            self.listener.close()


def _peer_error(state: _Peer, why: str) -> PeerError:
    """A failure of this peer's connection, naming the peer (culprit: the rank to blame)."""
    exc = PeerError(why)
    exc.culprit = exc.peer = state.rank
    return exc


def _unsent(parts: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of a gathered send after `sent` bytes went out."""
    while parts and sent >= len(parts[0]):
        sent -= len(parts[0])
        parts = parts[1:]
    if parts and sent:
        parts = [parts[0][sent:], *parts[1:]]
    return parts


WATCH_S = 0.1


def _in_slices(deadline: float, watch: Callable[[], None] | None, attempt: Callable[[float], Any]) -> Any:
    """attempt(deadline), or with watch: attempts with short deadlines, calling watch (which raises
    when the group being formed is abandoned) between them, until the real deadline."""
    if watch is None:
        return attempt(deadline)
    while True:
        watch()
        try:
            return attempt(min(deadline, time.monotonic() + WATCH_S))
        except PeerError:
            if time.monotonic() >= deadline:
                raise


def mesh_listener(host: str) -> tcp.Listener:
    """A listener for a mesh to form on (port 0: a free one). JACKLRING_LOCAL_TRANSPORT=unix:
    loopback peers connect through its abstract Unix socket, skipping the TCP/IP stack. Not by
    default: a peer that fails and exits breaks a Unix socket at once, so its neighbours may
    report the broken pipe instead of the mismatch that made it fail (TCP still takes their
    messages)."""
    return tcp.Listener(host, 0, local=config.get("JACKLRING_LOCAL_TRANSPORT") == "unix")


def connect_mesh(rank: int, size: int, peers: list[int], host: str, exchange: Exchange,
                 token: int, deadline: float, job: tcp.Auth,
                 watch: Callable[[], None] | None = None, listener: tcp.Listener | None = None) -> TcpMeshTransport:
    """Form the TCP mesh: every rank listens, the addresses are all-gathered with `exchange`
    (called exactly once, on every rank), then each rank connects to its lower peers and accepts
    its higher ones. Listening happens before the exchange, so no connect can arrive early.
    Every connection proves `job`'s key for job context `token` (tcp.connect / Listener).
    watch (a split, a shrink): called every WATCH_S while waiting; raises when a member is gone.
    listener: one from mesh_listener() whose address the caller already handed out (a shrink's
    join), else a new one. The transport keeps it open: shrink's agreement reaches this rank
    there (hellos of PURPOSE_SHRINK from any other rank)."""
    higher = {p for p in peers if p > rank}
    if listener is None:
        listener = mesh_listener(host)

    def admit(h: tcp.Hello) -> str | None:
        if h.purpose == PURPOSE_MESH and h.sender in higher and h.channel == 0:
            return None
        if h.purpose == PURPOSE_SHRINK and 0 <= h.sender < size and h.sender != rank:
            return None
        return f"not a mesh connection from a higher rank ({sorted(higher)}) nor a shrink of this group"

    listener.serve(job, token, rank, admit, f"rank {rank} (TCP mesh)")
    try:
        address = listener.where()
        blobs = exchange(json.dumps({"addr": address}).encode())
        everyone = [json.loads(blob)["addr"] for blob in blobs]
        addresses = {p: everyone[p] for p in peers}
        sockets: dict[int, socket.socket] = {}
        waiting: list[int] = []
        try:
            for p in peers:
                if p < rank:
                    hello = tcp.Hello(PURPOSE_MESH, rank, p, 0, token)
                    target = tcp.parse_address(addresses[p], f"rank {p}'s mesh address")
                    waiting = [p]
                    sockets[p] = _in_slices(deadline, watch, lambda until, target=target, hello=hello, p=p: tcp.connect(
                        target, hello, until, f"rank {p} (JACCL TCP mesh)", job))
            while higher - set(sockets):
                waiting = sorted(higher - set(sockets))
                sock, hello = _in_slices(deadline, watch, lambda until, waiting=waiting: listener.take(
                    lambda h: h.purpose == PURPOSE_MESH and h.sender not in sockets, until,
                    f"JACCL ranks {waiting} (TCP mesh, rank {rank})"))
                sockets[hello.sender] = sock
        except PeerError as exc:
            for s in sockets.values():
                s.close()
            if waiting:
                exc.mesh_rank = waiting[0]  # type: ignore[attr-defined]  # whom it connected to or waited for
            raise
        except BaseException:
            for s in sockets.values():
                s.close()
            raise
    except BaseException:
        listener.close()
        raise
    my_host = tcp.parse_address(address)[0]
    local_ranks = sum(1 for a in everyone if tcp.parse_address(a)[0] == my_host)
    labels = {p: f"rank {p} (JACCL TCP mesh, {addresses[p]})" for p in peers}
    return TcpMeshTransport(rank, size, sockets, labels=labels, spin_s=spin_seconds(local_ranks), listener=listener,
                            addresses=everyone)
