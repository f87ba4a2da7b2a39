"""JACCL's frame header: the fields every frame starts with (the request it belongs to, the
message's sequence number on its link, the frame's index), the verification flag, and the stage
tag a leaders' mesh adds so that leaders' frames name the group's operation."""
from __future__ import annotations

import struct

from ..protocol import OP_CODES, Request

# kind (| VERIFY_FLAG), reduce op, dtype code, phase, sequence, frame index, extra (root / peer), request bytes
HEADER = struct.Struct("<BBBBIIiQ")
VERIFY_FLAG = 0x80
SEQ_MASK = 0xFFFFFFFF
# On the leaders' mesh of a group spanning hosts (local/staged.py) every frame's extra also
# carries the group's operation (and a broadcast's root), so leaders' collectives that look alike
# but stage different operations of the group mismatch: bit 30 set, the operation from bit 26,
# the root (mod 2**14) from bit 12, the leaders' own extra (a root among the hosts) below.
STAGE_BIT, STAGE_SHIFT, DETAIL_SHIFT = 1 << 30, 26, 12
DETAIL_MASK, OWN_MASK = (1 << 14) - 1, (1 << 12) - 1
_REDUCING = (OP_CODES["all_reduce"], OP_CODES["reduce_scatter"])


def stage_tag(op_code: int, detail: int) -> int:
    return STAGE_BIT | op_code << STAGE_SHIFT | (detail & DETAIL_MASK) << DETAIL_SHIFT if op_code else 0


def staged_request(request: Request, extra: int) -> Request:
    """The request a frame's fields stand for: with a stage tag in extra, the group's operation."""
    if extra < 0 or not extra & STAGE_BIT:
        return request
    op = extra >> STAGE_SHIFT & 0xF
    detail = extra >> DETAIL_SHIFT & DETAIL_MASK
    return Request(op, request.reduce if op in _REDUCING else 0, request.dtype, request.nbytes,
                   detail if op == OP_CODES["broadcast"] else 0)


HEADER_BYTES = HEADER.size
