"""The ring backend's use of shared memory: when every rank of a group is on this host, its
collectives run over a transport.shm segment instead of the ring sockets (which stay open: they
carry send/recv, split's exchange, and tell a waiting rank that a neighbour died).

JACKLRING_LOCAL_TRANSPORT chooses: auto and shm use shared memory when the whole group is on one
host (shm also logs a warning when it cannot); unix and tcp never do. Ranks that disagree fall
back to sockets together, since the decision is collective.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from ... import config
from ..transport import shm
from ..transport.shm import SharedGroup

if TYPE_CHECKING:
    from .backend import RingBackend

log = logging.getLogger("jacklring.ring")


def attach(backend: "RingBackend", gather: Callable[[bytes], list[bytes]]) -> SharedGroup | None:
    """Form the group's shared segment (a collective over the ring), or None for sockets."""
    mode = config.get("JACKLRING_LOCAL_TRANSPORT")
    chunk = -(-config.get("JACKLRING_SHM_CHUNK_BYTES") // shm.PAGE) * shm.PAGE
    n = backend.size()
    group = shm.form(backend.rank(), n, gather, chunk, wanted=mode in ("auto", "shm"))
    if group is None:
        if mode == "shm":
            log.warning("rank %d: JACKLRING_LOCAL_TRANSPORT=shm but the group cannot share memory; "
                        "using sockets", backend.rank())
        return None
    # Checking while yielding the CPU costs a system call per check (well under a microsecond)
    # and never keeps a peer that waits for this CPU off it, whatever else the host runs; pure
    # busy-spinning measured several times slower on a loaded host, so it is off unless asked for.
    spin_us = config.get("JACKLRING_SPIN_US")
    group.spin_s = (spin_us or 0.0) * 1e-6
    group.yield_s = config.get("JACKLRING_SHM_YIELD_US") * 1e-6
    group.stall_report_s = config.get("JACKLRING_STALL_REPORT")
    for link in backend.right + backend.left:
        group.watch(link.fd, link.label, link.peer)
    return group


def run(backend: "RingBackend", body: Callable, *args) -> None:
    """Run one collective over the backend's shared memory, body(group, *args), under the
    backend's current deadline and description; on any error tell the peers at once, so those
    waiting for this rank fail now instead of at the deadline."""
    group = backend._shm
    group.deadline = backend._deadline
    group.what = backend._what
    try:
        body(group, *args)
    except BaseException as exc:
        group.mark_broken(getattr(exc, "culprit", -1))  # whom the peers should blame
        raise
