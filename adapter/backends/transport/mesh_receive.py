"""The TCP mesh's receive path: each peer's byte stream turned into completed receives (into
slots, or straight into a caller's buffer), failure notices read in band, the read-ahead
buffer and the spill refilled, a closed connection noticed. A part of TcpMeshTransport
(tcp_mesh.py), which provides _done, _set_mask, frame_bytes and the read-ahead switch."""
from __future__ import annotations

import select

from ...errors import PeerError, with_failure
from .blame import relay_error
from .mesh_peer import INBUF_BYTES, LEN, LS, NOTICE, OUTER, READ, STUCK, MeshPeer, peer_error
from .slots import RECV, Completion

_new = tuple.__new__


class MeshReceiving:
    """The receive half of TcpMeshTransport (a mixin: the state it reads is the transport's)."""

    def _progress_recv(self, state: MeshPeer) -> None:
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
                            raise peer_error(state, self._closed_text(state))
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
                space = INBUF_BYTES - state.in_end
                if not space or state.spill.chunks:
                    # Full and nobody waiting on this peer yet: keep reading into the spill, up to
                    # its limit, so a peer blocked sending to us can finish and read our messages
                    # (while the caller allows it: see read_ahead).
                    if state.spill.full() or not (self._spill_allowed or state.recvs):
                        self._set_mask(state, state.mask & ~READ)
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

    def _refill(self, state: MeshPeer) -> None:
        """Move spilled bytes into the read-ahead buffer's free space (they come right after it)."""
        if state.in_start:
            tail = state.in_end - state.in_start
            state.inbuf[:tail] = state.inview[state.in_start:state.in_end]
            state.in_start, state.in_end = 0, tail
        if state.in_end < INBUF_BYTES:
            state.in_end += state.spill.take(state.inview[state.in_end:])
        if not state.spill.full() and not state.mask & select.POLLIN and state.gone is None:
            self._set_mask(state, state.mask | READ)

    def _parse(self, state: MeshPeer) -> bool:
        """Take one message (or the start of a large one) out of the read-ahead buffer."""
        start = state.in_start
        have = state.in_end - start
        if have < LS:
            return False
        (length,) = LEN.unpack_from(state.inbuf, start)
        if length == NOTICE | STUCK:
            state.stuck = True  # not an end: whom it blames may follow (notify_failure)
            state.in_start += LS
            return True
        if length & NOTICE and length & OUTER:
            outer = length & ~(NOTICE | OUTER)
            exc = relay_error("", outer, state.rank, f"{state.label}, naming it by its rank in the group spanning the hosts")
            # No rank of this mesh is at fault: nothing to pass on to its other peers.
            with_failure(exc, culprit=None, outer_culprit=outer)
            state.gone = str(exc)
            raise exc
        if length & NOTICE:
            exc = relay_error("", length & ~NOTICE, state.rank, state.label)
            state.gone = str(exc)
            raise exc
        if length > self.frame_bytes:
            raise PeerError(f"{state.label} sent a {length}-byte message, larger than the "
                            f"{self.frame_bytes}-byte slot (different jacklring versions?)")
        body = start + LS
        slot = state.recvs[0]
        if have - LS >= length:
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
        if length <= INBUF_BYTES - LS:
            return False  # a small message still arriving: read more into the buffer
        got = state.in_end - body
        if state.divert[slot] is not None:
            self._take_divert(state, slot, length)
        self._place(state, slot, state.inview[body:state.in_end])
        state.in_start = state.in_end = 0
        state.body_len, state.body_got = length, got
        return True

    @staticmethod
    def _take_divert(state: MeshPeer, slot: int, length: int) -> None:
        """The message for this slot has begun: use its diverted view if the length fits it."""
        head, into = state.divert[slot]
        state.divert[slot] = None
        state.body_into, state.body_head = (into, head) if length == head + len(into) else (None, 0)

    @staticmethod
    def _dest(state: MeshPeer, slot: int, start: int, end: int) -> memoryview:
        """Where the message's bytes [start, end) go: the slot, or past the head the diverted view
        (one of the two: the returned view may be shorter)."""
        into = state.body_into
        if into is None:
            return state.recv_views[slot][start:end]
        head = state.body_head
        if start < head:
            return state.recv_views[slot][start:min(end, head)]
        return into[start - head:end - head]

    def _place(self, state: MeshPeer, slot: int, data: memoryview) -> None:
        """Copy the first len(data) bytes of a message to where they belong."""
        pos, n = 0, len(data)
        while pos < n:
            dest = self._dest(state, slot, pos, n)
            dest[:] = data[pos:pos + len(dest)]
            pos += len(dest)

    def _finish_recv(self, state: MeshPeer, nbytes: int) -> None:
        state.body_into = None
        self._done.append(_new(Completion, (RECV, state.rank, state.recvs.popleft(), nbytes)))

    def _connection_ended(self, state: MeshPeer, why: str) -> None:
        """End of stream or a reset. An error only once a message from this peer is awaited: a
        peer that finished and closed while this rank talks to others is no failure."""
        state.gone = why
        self._set_mask(state, state.mask & ~READ)
        if state.recvs:
            raise peer_error(state, why)

    @staticmethod
    def _closed_text(state: MeshPeer) -> str:
        return f"{state.label} closed the connection (the process exited or failed)"
