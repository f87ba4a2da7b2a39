"""The ring backend's use of shared memory: when every rank of a group is on this host, its
collectives run over a local.shm segment instead of the ring sockets (which stay open: they
carry send/recv, split's exchange, and tell a waiting rank that a neighbour died). When the group
spans hosts and some host has several of its ranks, each such host gets a segment of its own and
the collectives run in stages (local/staged.py, with this backend as the leaders' ring: a
split of the group, one rank per host). The settings and the error marking are
backend-neutral (local/use.py); what is the ring's own is its header and its links.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from ..elements import dtype_code
from ..local import shm, staged, use
from ..local.segment import OP_CODES
from ..protocol import REDUCE_CODES
from .header import FAST_PATH_OPS, HEADER, HEADER_MAGIC, OP_SHM, SEQ_MASK, describe_header
from .plumbing import Plumbing
from .state import RingState

if TYPE_CHECKING:
    from .backend import RingBackend


def attach_memory(ring: "RingBackend", state: RingState, plumbing: Plumbing) -> None:
    """Give the group its shared memory, if it has some: state.shm when every rank is on this
    host, state.hier (the staged collectives, formed by a split of `ring`) when it spans hosts
    and some host has several of its ranks; neither for sockets only."""
    def gather(record: bytes) -> list[bytes]:
        header = HEADER.pack(HEADER_MAGIC, OP_SHM, dtype_code(np.uint8), state.seq & SEQ_MASK, len(record), 0)
        parts: list[bytes] = []
        plumbing.collective(header, lambda: parts.extend(
            bytes(p) for p in plumbing.small_gather(header, memoryview(record))))
        return parts
    placement = attach(state, gather)
    if not placement.shared:
        return
    if len(placement.hosts) == 1:
        state.shm = placement.group
        return
    state.hier = staged.form(ring, placement, "ring")


def fast_path(state: RingState) -> object | None:
    """The engine's one-call collectives over the whole group's segment (None without one): each
    takes the shell's lock, refuses once the group failed, numbers with the shell's sequence and
    packs the ring's header, as Plumbing.header, RingBackend.barrier and the shell's on_segment do."""
    if state.shm is None or state.shm.size != state.size or state.hier is not None:
        return None
    extras = [REDUCE_CODES[op] + state.stage for op, _ in sorted(OP_CODES.items(), key=lambda item: item[1])]
    return state.shell.fast_path(state.timeout, HEADER_MAGIC, list(FAST_PATH_OPS), extras,  # type: ignore[union-attr]
                                 stage=state.stage)


def attach(state: RingState, gather: Callable[[bytes], list[bytes]]) -> shm.Placement:
    """Find which ranks share a host and give each such host a shared segment (a collective
    over the ring); placement.shared is False, with no segment anywhere, for sockets only."""
    placement = use.attach(state.rank, state.size, gather, describe_header)
    group = placement.group
    if group is not None and len(placement.hosts) == 1:
        for link in state.right + state.left:
            group.watch(link.fd, link.label, link.peer)
    return placement
