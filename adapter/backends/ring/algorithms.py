"""Ring collectives written against Links (post_send / post_recv), not sockets.

A Channel is one direction of the ring over one connection: this rank sends to the next
position on `out` and receives from the previous position on `inp`. The caller splits each
buffer across channels (several connections, both directions) and every channel runs the
same schedule on its own piece, so all of them are on the wire at once.

Chunks are indexed by ring position. Reduce-scatter leaves position p holding chunk p,
fully reduced; all-gather then circulates the owned chunks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..base import ReduceOp
from ..elements import byte_view, reduce_into
from ..transport.stream_engine import Stream


@dataclass
class Channel:
    out: Stream
    inp: Stream
    pos: int  # this rank's position in the channel's direction of the ring


def segments(length: int, seg_elems: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + seg_elems, length)) for lo in range(0, length, seg_elems)] or [(0, 0)]


def reduce_scatter_all_gather(
    ch: Channel,
    n: int,
    src: Sequence[np.ndarray],
    acc: Sequence[np.ndarray],
    out: Sequence[np.ndarray] | None,
    op: ReduceOp,
    scratch: np.ndarray,
    seg_elems: int,
) -> None:
    """Post the ring reduce-scatter (src -> acc) and, when out is given, the all-gather after it.

    src[i], acc[i], out[i] are this channel's views of chunk i (by position). acc[p] is where
    this rank's reduced chunk lands; with out, acc and out are the same arrays.
    """
    p = ch.pos
    for lo, hi in segments(len(src[(p - 1) % n]), seg_elems):
        ch.out.post_send(byte_view(src[(p - 1) % n][lo:hi]))
    tmp_bytes = byte_view(scratch)
    itemsize = scratch.itemsize
    for step in range(n - 1):
        q = (p - step - 2) % n
        forward = step < n - 2 or out is not None
        for lo, hi in segments(len(src[q]), seg_elems):
            ch.inp.post_recv(tmp_bytes[: (hi - lo) * itemsize],
                             _reduce_then_forward(ch.out, acc[q][lo:hi], src[q][lo:hi], scratch[: hi - lo], op, forward))
    if out is not None:
        _gather_steps(ch, n, out, seg_elems)


def _reduce_then_forward(link: Stream, dst: np.ndarray, local: np.ndarray, incoming: np.ndarray,
                         op: ReduceOp, forward: bool) -> Callable[[], None]:
    def done() -> None:
        reduce_into(dst, local, incoming, op)
        if forward:
            link.post_send(byte_view(dst))
    return done


def all_gather(ch: Channel, n: int, out: Sequence[np.ndarray], seg_elems: int) -> None:
    """Post the ring all-gather: out[p] holds this rank's chunk; every other chunk arrives."""
    for lo, hi in segments(len(out[ch.pos]), seg_elems):
        ch.out.post_send(byte_view(out[ch.pos][lo:hi]))
    _gather_steps(ch, n, out, seg_elems)


def _gather_steps(ch: Channel, n: int, out: Sequence[np.ndarray], seg_elems: int) -> None:
    p = ch.pos
    for step in range(n - 1):
        q = (p - step - 1) % n
        forward = step < n - 2
        for lo, hi in segments(len(out[q]), seg_elems):
            view = byte_view(out[q][lo:hi])
            ch.inp.post_recv(view, _forward(ch, view) if forward else None)


def _forward(ch: Channel, view: memoryview) -> Callable[[], None]:
    return lambda: ch.out.post_forward(view, ch.inp)


def chain_broadcast(ch: Channel, n: int, root_pos: int, buf: np.ndarray, seg_elems: int) -> None:
    """Pipeline buf from root_pos along the channel's direction; the last position does not forward."""
    p = ch.pos
    last = (root_pos - 1) % n
    if p == root_pos:
        for lo, hi in segments(len(buf), seg_elems):
            ch.out.post_send(byte_view(buf[lo:hi]))
        return
    for lo, hi in segments(len(buf), seg_elems):
        view = byte_view(buf[lo:hi])
        ch.inp.post_recv(view, None if p == last else _forward(ch, view))
