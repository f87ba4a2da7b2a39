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

import select
import socket
import time

from ... import config
from ...errors import CollectiveTimeout, failure_of
from . import tcp
from .mesh_peer import LEN, LS, NOTICE, OUTER, READ, STUCK, MeshPeer, peer_error, unsent
from .mesh_receive import MeshReceiving
from .slots import RECV, SEND, BufferPool, Completion, Transport
from .tcp import available_cpus, spin_seconds  # noqa: F401  (shared with the ring)

FRAME_BYTES = 1 << 20
SLOTS = 2
# Below this a frame's data is copied into its slot (one send call); above it the slot's header
# and the caller's memory go out together with sendmsg, saving a copy of every byte.
_GATHER_MIN_BYTES = 64 << 10
# With read-ahead off, how long poll waits with nothing moving before reading ahead anyway.
STUCK_READ_AHEAD_S = 0.2
_new = tuple.__new__


class TcpMeshTransport(MeshReceiving, Transport):
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
        self._peers: list[MeshPeer | None] = [None] * size
        for p, s in sockets.items():
            s.setblocking(False)
            self._peers[p] = MeshPeer(p, s, labels.get(p, f"rank {p} (JACCL TCP mesh)"), slots, self.spill_limit)
        self._by_fd = {state.fd: state for state in self._peers if state is not None}
        # Buffers carry 8 spare bytes in front so the length prefix and body go out in one send.
        self._pool = BufferPool(frame_bytes, lambda n, key: bytearray(n + LS))
        self._poller = select.poll()
        for state in self._by_fd.values():
            self._set_mask(state, READ)
        self._done: list[Completion] = []
        self._closed = False
        self.posted_bytes = 0   # message bytes posted for sending (what an algorithm puts on the wire)
        self.spin_s = spin_seconds(size) if spin_s is None else spin_s
        self._spill_allowed = True
        self._paused: list[MeshPeer] = []   # not read while read-ahead was off; read again when it is on

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
                    self._set_mask(state, state.mask | READ)
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

    def _make_send(self, state: MeshPeer, slot: int) -> memoryview:
        raw = memoryview(self._pool.get(state.rank, SEND, slot))
        state.send_raw[slot] = raw
        view = state.send_views[slot] = raw[LS:]
        return view

    def _make_recv(self, state: MeshPeer, slot: int) -> memoryview:
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
        LEN.pack_into(raw, 0, nbytes)
        view = raw[:LS + nbytes]
        if not state.sends:  # the usual case: the whole message leaves in this one call
            try:
                sent = state.sock.send(view)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                raise peer_error(state, f"sending to {state.label} failed: {exc.strerror or exc}") from None
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
        LEN.pack_into(raw, 0, nbytes)
        parts = [raw[:LS + head], data]
        if tail:
            parts.append(raw[LS + head:LS + head + tail])
        if not state.sends:
            try:
                sent = state.sock.sendmsg(parts)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                raise peer_error(state, f"sending to {state.label} failed: {exc.strerror or exc}") from None
            parts = unsent(parts, sent)
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
                raise peer_error(state, state.gone)
            if not state.mask & select.POLLIN:
                self._set_mask(state, state.mask | READ)

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

    def _progress_send(self, state: MeshPeer) -> None:
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
                raise peer_error(state, f"sending to {state.label} failed: {exc.strerror or exc}") from None
            item[1] = unsent(pending, sent) if gather else pending[sent:]
            if len(item[1]):
                return
            sends.popleft()
            self._done.append(_new(Completion, (SEND, state.rank, item[0], item[2])))
        self._set_mask(state, state.mask & ~select.POLLOUT)

    def _set_mask(self, state: MeshPeer, mask: int) -> None:
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
            if state.in_end - state.in_start >= LS:
                head = bytes(state.inview[state.in_start:state.in_start + LS])
            else:
                try:
                    head = bytes(state.inview[state.in_start:state.in_end]) + state.sock.recv(
                        LS - (state.in_end - state.in_start), socket.MSG_PEEK | socket.MSG_DONTWAIT)
                except OSError:
                    continue
            if len(head) == LS:
                (length,) = LEN.unpack(head)
                if length & NOTICE and not length & (STUCK | OUTER):
                    found[state.rank] = length & ~NOTICE
        return found

    def notify_failure(self, exc: BaseException) -> None:
        """Before this rank gives up because a peer's connection failed, tell every other live
        peer whom it blames, so that a peer waiting on this rank names the rank that died rather
        than this one. In band: an 8-byte notice where a message length would come, sent only on
        connections with no message half-sent (the peer then expects a length there), without
        blocking. Best effort: a connection in mid-message just closes as before."""
        failure = failure_of(exc)
        culprit = failure.culprit
        if culprit is None or not 0 <= culprit < self.size:
            return
        self._notify_live_peers(LEN.pack(NOTICE | culprit), skip=(culprit, failure.peer))

    def notify_outer(self, culprit: int) -> None:
        """On a leaders' mesh (local/staged.py): tell every live peer, in band as notify_failure,
        that this rank gives up because of rank `culprit` of the whole group (none when < 0)."""
        if culprit >= 0:
            self._notify_live_peers(LEN.pack(NOTICE | OUTER | culprit))

    def notify_stuck(self) -> None:
        """This rank's deadline passed: tell every live peer it is stuck too (in band, as
        notify_failure), so a peer waiting for it does not take it for the silent rank."""
        self._notify_live_peers(LEN.pack(NOTICE | STUCK))

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
