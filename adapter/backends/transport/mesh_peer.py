"""The TCP mesh's wire and connection state: every message is an 8-byte length and the bytes;
a length with the notice bit set is a failing rank's last word instead (blame.py's rule). One
MeshPeer per connection holds its slot buffers, read-ahead buffer, spill and queues of posted work."""
from __future__ import annotations

import select
import socket
import struct
from collections import deque

from ...errors import LINK, PeerError, with_failure
from .spill import Spill

# A length with this bit set is no message but a failing rank's last word: the rest is the
# rank it blames (see notify_failure; the words and the rule are blame.py's, as the ring's).
NOTICE = 1 << 63
STUCK = 1 << 62  # a notice of NOTICE | STUCK: "this rank timed out too, waiting for another"
# A notice of NOTICE | OUTER | q, on a leaders' mesh (local/staged.py): rank q of the whole
# group whose hosts the mesh links failed (see notify_outer).
OUTER = 1 << 61
LEN = struct.Struct("<Q")
LS = LEN.size
INBUF_BYTES = 64 << 10
READ = select.POLLIN | select.POLLPRI


class MeshPeer:
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
        self.inbuf = bytearray(INBUF_BYTES)
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

def peer_error(state: MeshPeer, why: str) -> PeerError:
    """A failure of this peer's connection, naming the peer (culprit: the rank to blame)."""
    return with_failure(PeerError(why), culprit=state.rank, peer=state.rank, how=LINK)  # type: ignore[return-value]


def unsent(parts: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of a gathered send after `sent` bytes went out."""
    while parts and sent >= len(parts[0]):
        sent -= len(parts[0])
        parts = parts[1:]
    if parts and sent:
        parts = [parts[0][sent:], *parts[1:]]
    return parts
