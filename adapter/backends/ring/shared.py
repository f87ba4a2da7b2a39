"""The ring backend's use of shared memory: when every rank of a group is on this host, its
collectives run over a local.shm segment instead of the ring sockets (which stay open: they
carry send/recv, split's exchange, and tell a waiting rank that a neighbour died). When the group
spans hosts and some host has several of its ranks, each such host gets a segment of its own and
the collectives run in stages (hierarchy.py).

JACKLRING_LOCAL_TRANSPORT chooses: auto and shm use shared memory between the ranks of a host
(shm also logs a warning when it cannot); unix and tcp never do. Ranks that disagree fall back to
sockets together, since the decision is collective.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from ... import config
from ..local import shm
from .header import describe_header

if TYPE_CHECKING:
    from .backend import RingBackend

log = logging.getLogger("jacklring.ring")


def attach(backend: "RingBackend", gather: Callable[[bytes], list[bytes]]) -> shm.Placement:
    """Find which ranks share a host and give each such host a shared segment (a collective
    over the ring); placement.shared is False, with no segment anywhere, for sockets only."""
    mode = config.get("JACKLRING_LOCAL_TRANSPORT")
    chunk = -(-config.get("JACKLRING_SHM_CHUNK_BYTES") // shm.PAGE) * shm.PAGE
    placement = shm.form(backend.rank(), backend.size(), gather, chunk, wanted=mode in ("auto", "shm"),
                         describe=describe_header)
    if not placement.shared:
        if mode == "shm":
            log.warning("rank %d: JACKLRING_LOCAL_TRANSPORT=shm but the group cannot share memory; "
                        "using sockets", backend.rank())
        return placement
    group = placement.group
    if group is None:
        return placement  # the only rank of the group on its host
    # Checking while yielding the CPU costs a system call per check (well under a microsecond)
    # and never keeps a peer that waits for this CPU off it, whatever else the host runs; pure
    # busy-spinning measured several times slower on a loaded host, so it is off unless asked for.
    spin_us = config.get("JACKLRING_SPIN_US")
    group.spin_s = (spin_us or 0.0) * 1e-6
    group.yield_s = config.get("JACKLRING_SHM_YIELD_US") * 1e-6
    group.stall_report_s = config.get("JACKLRING_STALL_REPORT")
    if len(placement.hosts) == 1:
        for link in backend.right + backend.left:
            group.watch(link.fd, link.label, link.peer)
    return placement


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
