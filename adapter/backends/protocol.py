"""The wire vocabulary every backend shares: one request record, one code table, one mismatch
message and one checksum trailer.

A request says what a rank asked for (operation, reduction, dtype, byte count, and an extra
word: the root of a broadcast, the peer of a send or recv, the tag of a torch message). The
ring's collective header, JACCL's frame header and the torch group's point-to-point envelope
all carry one, so a disagreement between two ranks is described the same way whichever
backend noticed it. Each transport lays the record out inside its own header (the ring adds a
sequence number, JACCL a phase and frame index); the meaning of the fields is defined here.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import IntegrityError
from .base import ReduceOp
from .elements import CODE_NAMES
from .transport.integrity import CRC as CHECKSUM  # noqa: F401  (the trailer layout, for the backends)
from .transport.integrity import CRC_NAME, crc

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "send", "split", "recv", "abort",
       "shared-memory set-up")
OP_CODES = {name: code for code, name in enumerate(OPS, 1)}
OP_NAMES = {code: name for name, code in OP_CODES.items()}
# 0 means "no reduction" in a record.
REDUCE_CODES = {op: code for code, op in enumerate(ReduceOp, 1)}
REDUCE_NAMES = {code: op.value for op, code in REDUCE_CODES.items()}

SEND, RECV, BROADCAST = OP_CODES["send"], OP_CODES["recv"], OP_CODES["broadcast"]


@dataclass(frozen=True)
class Request:
    """What one rank asked for; every rank taking part must ask for the same thing (a recv
    matches the peer's send of the same dtype and size)."""
    op: int
    reduce: int = 0
    dtype: int = 0
    nbytes: int = 0
    extra: int = 0

    def _name(self) -> str:
        return OP_NAMES.get(self.op, f"unknown operation {self.op}")

    def _dtype(self) -> str:
        return CODE_NAMES.get(self.dtype, f"dtype code {self.dtype}") if self.dtype else "bytes"

    def _peer_text(self) -> str:
        if self.op == BROADCAST:
            return f" from root {self.extra}"
        if self.op == SEND:
            return f" to rank {self.extra}"
        if self.op == RECV:
            return f" from rank {self.extra}"
        return ""

    def describe(self) -> str:
        """'all_reduce(sum) of 16 bytes (float32)', 'send of 8 bytes (int64) to rank 2'."""
        name = self._name()
        if self.reduce:
            name += f"({REDUCE_NAMES.get(self.reduce, self.reduce)})"
        return f"{name} of {self.nbytes} bytes ({self._dtype()}){self._peer_text()}"

    def label(self, seq: int) -> str:
        """For timeouts and stall reports: 'all_reduce(sum, float32, 4096 bytes, seq 7)'."""
        reduce = f"{REDUCE_NAMES.get(self.reduce, self.reduce)}, " if self.reduce else ""
        return f"{self._name()}({reduce}{self._dtype()}, {self.nbytes} bytes, seq {seq}){self._peer_text()}"


def mismatch_message(rank: int, peer: int | str, mine: Request, theirs: Request, detail: str = "") -> str:
    """The one wording of "two ranks asked for different things", for every backend. peer is a
    rank, or a phrase such as "another rank" when the backend cannot tell which."""
    who = f"rank {peer}" if isinstance(peer, int) else peer
    return (f"rank {rank}: mismatched operations with {who}: rank {rank} called {mine.describe()}, "
            f"{who} called {theirs.describe()}{detail}")


# ---- the checksum trailer (JACKLRING_VERIFY) ------------------------------------------------------

def checksum(data: bytes | bytearray | memoryview, start: int = 0) -> int:
    """CRC-32C of data (transport/integrity.py: the CPU's crc32 instruction), continuing from
    `start` (to cover a header and a payload in two calls)."""
    return crc(data, start)


def checksum_error(nbytes: int, who: str, actual: int, expected: int, rank: int | None = None,
                   during: str = "") -> IntegrityError:
    """The one wording of a failed checksum: which message, from whom, both values."""
    prefix = "" if rank is None else f"rank {rank}: "
    return IntegrityError(f"{prefix}checksum mismatch on a {nbytes}-byte message from {who}{during}: "
                          f"{CRC_NAME} {actual:#010x}, sender's {expected:#010x}")
