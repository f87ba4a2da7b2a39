"""The ring backend's use of shared memory: when every rank of a group is on this host, its
collectives run over a local.shm segment instead of the ring sockets (which stay open: they
carry send/recv, split's exchange, and tell a waiting rank that a neighbour died). When the group
spans hosts and some host has several of its ranks, each such host gets a segment of its own and
the collectives run in stages (hierarchy.py). The settings and the error marking are
backend-neutral (local/use.py); what is the ring's own is its header and its links.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..local import shm, use
from .header import describe_header

if TYPE_CHECKING:
    from .backend import RingBackend


def attach(backend: "RingBackend", gather: Callable[[bytes], list[bytes]]) -> shm.Placement:
    """Find which ranks share a host and give each such host a shared segment (a collective
    over the ring); placement.shared is False, with no segment anywhere, for sockets only."""
    placement = use.attach(backend.rank(), backend.size(), gather, describe_header)
    group = placement.group
    if group is not None and len(placement.hosts) == 1:
        for link in backend.right + backend.left:
            group.watch(link.fd, link.label, link.peer)
    return placement


def run(backend: "RingBackend", body: Callable, *args) -> None:
    """Run one collective over the backend's shared memory, body(group, *args), under the
    backend's current deadline and description; on any error the peers are told at once."""
    use.run(backend._shm, backend._deadline, backend._what, body, *args)
