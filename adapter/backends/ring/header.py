"""The ring's wire header: 24 bytes that open every collective and message.

magic, operation, dtype code, sequence number, byte count, and an extra field (a reduce op, a
broadcast's root, or for a leaders' collective of a group spanning hosts the group's operation:
stage_tag). Neighbours compare headers before any data is used, so two ranks that called
different collectives both raise a MismatchError; an abort header (find_abort) tells a
neighbour which rank failed.
"""
from __future__ import annotations

import struct

from ..protocol import OP_CODES, Request

HEADER = struct.Struct("<HBBIQq")  # magic, op, dtype code, sequence, byte count, extra (reduce op / root)
# The header's sequence field is 32 bits: the count wraps there (as the engine's fast path packs it).
SEQ_MASK = 0xFFFFFFFF
HEADER_MAGIC = 0x4A4B
OP_ALL_REDUCE, OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_BROADCAST, OP_BARRIER, OP_SEND, OP_SPLIT, OP_ABORT, OP_SHM = (
    OP_CODES[name] for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "send", "split",
                                "abort", "shared-memory set-up"))
_REDUCING = (OP_ALL_REDUCE, OP_REDUCE_SCATTER)
# The codes in the order the engine's fast path takes them (local/segment.py SharedGroup.fast_path).
FAST_PATH_OPS = (OP_ALL_REDUCE, OP_REDUCE_SCATTER, OP_ALL_GATHER, OP_BROADCAST, OP_BARRIER)
# A member that gives up forming a ring sends an abort header (sequence = the reporting rank,
# extra = the rank that failed, or -1) before it stops writing; see formation.py.
# Its dtype byte says why: the culprit died or gave up, or never connected before the deadline.
ABORT_DIED, ABORT_MISSING = 0, 1
# Or the reporter found that the culprit holds another layout (layout.py): the byte count then
# carries the culprit's world size (high 32 bits) and the reporter's (low 32 bits).
ABORT_LAYOUT = 2

# What a connection to a ring rank's listener is for (its hello's purpose; origin.py's notices
# are 4).
PURPOSE_RING = 1
PURPOSE_P2P = 2
PURPOSE_ABORT = 3  # a rank that gave up forming tells a ring neighbour it had no connection with yet
PURPOSE_SHRINK = 5  # shrink's agreement (ring/shrink.py, elastic/membership.py) at a formed ring's first listener


def admits_shrink(sender: int, rank: int, size: int) -> str | None:
    """Who may open a shrink connection to this rank's first listener: any other old member."""
    return None if 0 <= sender < size and sender != rank else f"no rank {sender} shrinks here"

# The header's extra field of a leaders' collective: the group's operation from bit 48, its
# detail (a broadcast's root) from bit 16, the leaders' own extra (a reduce op, a root among
# the leaders) below.
STAGE_SHIFT, DETAIL_SHIFT = 48, 16
_DETAIL_MASK, _OWN_MASK = (1 << 32) - 1, (1 << 16) - 1


def stage_tag(op_code: int, detail: int) -> int:
    return op_code << STAGE_SHIFT | detail << DETAIL_SHIFT


def untag(extra: int) -> tuple[int, int, int]:
    """(the group's operation or 0, its detail, the leaders' own extra) of a header's extra."""
    if extra < 0:
        return 0, 0, extra
    return extra >> STAGE_SHIFT, extra >> DETAIL_SHIFT & _DETAIL_MASK, extra & _OWN_MASK


def header_request(raw: bytes) -> Request | None:
    """The request a ring header carries (None when it is not a ring header at all)."""
    magic, op, dt, _seq, nbytes, extra = HEADER.unpack(raw)
    if magic != HEADER_MAGIC:
        return None
    stage_of, detail, own = untag(extra)
    if stage_of:  # a stage, on the leaders' ring, of a collective of a group spanning hosts
        op, extra = stage_of, (own if stage_of in _REDUCING else detail)
    if op in _REDUCING:
        return Request(op, reduce=extra, dtype=dt, nbytes=nbytes)
    return Request(op, dtype=dt, nbytes=nbytes, extra=extra if op == OP_BROADCAST else 0)


def find_abort(data: bytes) -> tuple[int, int, bool] | None:
    """(reporter, culprit, missing) of the first abort header among the headers peeked in data.
    A neighbour may have sent its next collective's header first: that is looked past."""
    for at in range(0, len(data) - HEADER.size + 1, HEADER.size):
        magic, op, reason, reporter, _, culprit = HEADER.unpack_from(data, at)
        if magic == HEADER_MAGIC and op == OP_ABORT:
            return reporter, culprit, reason == ABORT_MISSING
    return None


def layout_abort_header(reporter: int, culprit: int, culprit_size: int, reporter_size: int) -> bytes:
    return HEADER.pack(HEADER_MAGIC, OP_ABORT, ABORT_LAYOUT, reporter, culprit_size << 32 | reporter_size, culprit)


def find_layout_abort(data: bytes) -> tuple[int, int, int, int] | None:
    """(reporter, culprit, culprit's world size, reporter's) when the first abort header among
    the headers peeked in data is about layouts that differ; None otherwise."""
    for at in range(0, len(data) - HEADER.size + 1, HEADER.size):
        magic, op, reason, reporter, sizes, culprit = HEADER.unpack_from(data, at)
        if magic == HEADER_MAGIC and op == OP_ABORT:
            return (reporter, culprit, sizes >> 32, sizes & 0xFFFFFFFF) if reason == ABORT_LAYOUT else None
    return None


def describe_header(raw: bytes) -> str:
    request = header_request(raw)
    if request is None:
        return f"garbage header {raw[:8].hex()}"
    return request.label(HEADER.unpack(raw)[3])
