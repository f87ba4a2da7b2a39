"""The transport interface JACCL's algorithms are written against, modelled on verbs.

Each peer has a few numbered slots per direction; each slot is one registered buffer of
`frame_bytes` bytes, allocated once (a BufferPool) and reused by every operation. An algorithm
fills a send slot and posts it, posts receive slots, and polls for completions:

    view = t.send_buffer(peer, slot); view[:n] = ...; t.post_send(peer, slot, n)
    t.post_recv(peer, slot)
    for c in t.poll(deadline): ...          # Completion(kind, peer, slot, nbytes)

Messages to one peer arrive in the order they were posted, each into the receive slot posted
for it in the same order (RC queue-pair semantics). A failed completion raises (PeerError naming
the peer); poll raises CollectiveTimeout at the deadline; nothing fails silently.
"""
from __future__ import annotations

import abc
from typing import Callable, Generic, NamedTuple, TypeVar

SEND = 1
RECV = 2
KIND_NAMES = {SEND: "send", RECV: "recv"}


class Completion(NamedTuple):
    """A tuple, so the latency path can unpack it (and build it) cheaply."""
    kind: int      # SEND or RECV
    peer: int
    slot: int
    nbytes: int    # bytes received (RECV) or sent (SEND)


B = TypeVar("B")


class BufferPool(Generic[B]):
    """Buffers keyed by (peer, kind, slot), each allocated on first use and then reused.

    `allocate(nbytes, key)` makes one buffer (a bytearray for TCP, a registered memory
    region for verbs); registration is expensive, so it happens once per key per transport.
    """

    def __init__(self, frame_bytes: int, allocate: Callable[[int, tuple[int, int, int]], B]) -> None:
        self.frame_bytes = frame_bytes
        self._allocate = allocate
        self._buffers: dict[tuple[int, int, int], B] = {}
        self.allocations = 0

    def get(self, peer: int, kind: int, slot: int) -> B:
        key = (peer, kind, slot)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._allocate(self.frame_bytes, key)
            self._buffers[key] = buf
            self.allocations += 1
        return buf

    def items(self):
        return self._buffers.items()

    def clear(self) -> None:
        self._buffers.clear()


class Transport(abc.ABC):
    """Point-to-point message passing between one rank and its directly connected peers."""

    name: str = "?"
    rank: int
    size: int
    peers: list[int]
    frame_bytes: int   # the largest message one slot carries
    slots: int         # slots per peer and direction

    def peer_label(self, peer: int) -> str:
        """How error messages name a peer (a transport may add its address)."""
        return f"rank {peer}"

    def backlog_note(self, peer: int) -> str:
        """For a timeout: why `peer` may not be taking frames (a transport with a bounded
        read-ahead says when its own buffer for that peer is full); empty when nothing is known."""
        return ""

    @abc.abstractmethod
    def send_buffer(self, peer: int, slot: int) -> memoryview:
        """The registered buffer of send slot `slot` to `peer` (do not touch while posted)."""

    @abc.abstractmethod
    def recv_buffer(self, peer: int, slot: int) -> memoryview:
        """The registered buffer of receive slot `slot` from `peer` (valid after its completion)."""

    @abc.abstractmethod
    def post_send(self, peer: int, slot: int, nbytes: int) -> None:
        """Send the first nbytes of the send slot as one message."""

    def post_send_parts(self, peer: int, slot: int, head: int, data: memoryview, tail: int = 0) -> None:
        """Send slot[:head] + data + slot[head:head + tail] as one message. data must stay
        unchanged until the send completes. This default copies data into the slot (registered
        memory needs it there); a transport that can send from any memory overrides it and
        saves that copy."""
        buf = self.send_buffer(peer, slot)
        n = len(data)
        trailer = bytes(buf[head:head + tail])
        buf[head:head + n] = data
        buf[head + n:head + n + tail] = trailer
        self.post_send(peer, slot, head + n + tail)

    def post_recv_into(self, peer: int, slot: int, head: int, view: memoryview) -> bool:
        """Like post_recv; a transport that can may put a message of exactly head + len(view)
        bytes into slot[:head] and view (returns True then: the caller must not copy the data
        out of the slot). This default does not: the whole message lands in the slot."""
        self.post_recv(peer, slot)
        return False

    def read_ahead(self, allowed: bool) -> None:
        """Whether the transport may read bytes that no posted receive waits for into memory of
        its own (the TCP mesh's spill); the caller allows it only while it sends without
        receiving. Transports that receive only into posted slots ignore it."""

    @abc.abstractmethod
    def post_recv(self, peer: int, slot: int) -> None:
        """Make the receive slot ready for the next message from peer."""

    @abc.abstractmethod
    def poll(self, deadline: float) -> list[Completion]:
        """At least one completion; CollectiveTimeout at the deadline; PeerError on a failure."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections and buffers. Safe to call twice."""
