"""A spill buffer: bytes read ahead from a peer's stream that nobody waits for yet, so a rank
blocked sending to that peer can go on reading it (two ranks that both send large messages
before receiving would otherwise wait for each other forever). At most `limit` bytes
(JACKLRING_P2P_SPILL_BYTES); the bytes come out in the order they came in.

Used by the ring's point-to-point streams (ring/point_to_point.py) and the TCP mesh
(tcp_mesh.py), which differ in when they read ahead, not in what they keep.
"""
from __future__ import annotations

from collections import deque

CHUNK = 1 << 20  # bytes read ahead at a time


class Spill:
    __slots__ = ("chunks", "bytes", "limit")

    def __init__(self, limit: int) -> None:
        self.chunks: deque[memoryview] = deque()  # empty when nothing is spilled (test this, it is cheap)
        self.bytes = 0
        self.limit = limit

    def full(self) -> bool:
        return self.bytes >= self.limit

    def new_chunk(self) -> bytearray:
        """Memory for the next read: a chunk, or what room is left."""
        return bytearray(min(CHUNK, self.limit - self.bytes))

    def keep(self, chunk: bytearray, n: int) -> None:
        """The first n bytes of chunk (from new_chunk) were read: they follow what is spilled."""
        self.chunks.append(memoryview(chunk)[:n])
        self.bytes += n

    def take(self, view: memoryview) -> int:
        """Copy the oldest spilled bytes into view (bytes, 1-D); returns how many."""
        got = 0
        chunks = self.chunks
        while chunks and got < len(view):
            chunk = chunks[0]
            n = min(len(chunk), len(view) - got)
            view[got:got + n] = chunk[:n]
            got += n
            if n == len(chunk):
                chunks.popleft()
            else:
                chunks[0] = chunk[n:]
        self.bytes -= got
        return got

    def full_note(self, source: str) -> str:
        """For a send that timed out: that the buffer of bytes from `source` is full (else "")."""
        if self.bytes < self.limit:
            return ""
        return (f"; {self.bytes} bytes from {source} wait in this rank's spill buffer, which is full "
                f"(JACKLRING_P2P_SPILL_BYTES={self.limit})")
