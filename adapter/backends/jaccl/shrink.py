"""shrink() for JACCL on the TCP mesh: the survivors agree (elastic/membership.py, reached at
each rank's mesh listener, which a formed mesh keeps open) and form a fresh mesh of themselves on
new listeners, under a key of the decision, ranks 0..k-1 in their old order (the loop, its
retries and the old group's tombstone are elastic/shrinking.py, shared with the ring). The
side channel (MLX_JACCL_COORDINATOR) takes no part: the decision carries every member's new
address. Shared memory attaches as at init when the survivors share a host.

RDMA groups do not shrink: their queue pairs are created once from the device file, and
re-creating them for the survivors is not written (JacclBackend.shrink_missing says so).
"""
from __future__ import annotations

import json
import time
import zlib
from typing import TYPE_CHECKING, Callable, Sequence

from ...errors import PeerError
from ..base import Backend
from ..elastic import membership, shrinking
from ..singleton import SingletonBackend
from ..transport import mesh_forming, tcp, tcp_mesh
from ..transport.auth import Auth

if TYPE_CHECKING:
    from .backend import JacclBackend

WATCH_EVERY_S = 0.25  # how often a forming mesh checks that the members it waits for still listen


def group_token(old_token: int, decision: membership.Decision) -> int:
    """The new mesh's job context id: from the old group's and the decision's (epoch, nonce)."""
    return zlib.crc32(f"{old_token}:shrink:{decision.epoch}:{decision.nonce.hex()}".encode())


def shrink_mesh(old: "JacclBackend", seat: membership.Seat, host: str, exclude: Sequence[int],
                min_size: int | None, timeout: float) -> Backend:
    """The mesh of the survivors, as this rank's new backend (see the module docstring)."""
    listen, form, token = mesh_parts(host, old.reformed)
    return shrinking.shrink(old, seat, old.size(), listen, form, token, old.break_links, exclude, min_size,
                            timeout)[0]


def mesh_parts(host: str, reform: Callable[[list[int], tcp_mesh.TcpMeshTransport, int, Auth], Backend]) -> tuple:
    """shrinking's listen, form and token for a JACCL mesh on `host`: a fresh mesh listener, and
    the mesh a decision names on it, made a backend by reform(members, transport, token, key)
    (members: ranks of the group the agreement is about, in order)."""

    def listen() -> list[tcp.Listener]:
        return [mesh_forming.mesh_listener(host)]

    def form(seat: membership.Seat, decision: membership.Decision, members: list[int], listeners: list[tcp.Listener],
             connect_timeout: float) -> Backend:
        if len(members) == 1:
            return SingletonBackend()
        rank, size = decision.members.index(seat.rank), len(members)
        addresses = [decision.payloads[q]["addrs"][0] for q in decision.members]
        token, job = group_token(seat.token, decision), decision.key(seat.auth)

        def exchange(blob: bytes) -> list[bytes]:  # the decision already holds every address
            return [json.dumps({"addr": a}).encode() for a in addresses]

        transport = mesh_forming.connect_mesh(rank, size, [p for p in range(size) if p != rank], host, exchange, token,
                                          time.monotonic() + connect_timeout, job,
                                          watch=watch(f"rank {members[rank]}: shrink", "the survivors' mesh",
                                                      {f"old rank {q} (new rank {i}, {a})": a
                                                       for i, (q, a) in enumerate(zip(members, addresses))
                                                       if q != members[rank]}),
                                          listener=listeners[0])
        return reform(members, transport, token, job)

    def token(seat: membership.Seat, decision: membership.Decision) -> int:
        return group_token(seat.token, decision)

    return listen, form, token


def watch(who: str, what: str, peers: dict[str, str]) -> Callable[[], None]:
    """A forming mesh's watch: raise PeerError when a peer's new listener refuses connections
    (its process is gone; a formed peer keeps listening there). peers: each peer's name in
    errors -> its listener's address. Looks every WATCH_EVERY_S, first after that long, so a
    quick formation probes nobody. Used by shrink and grow (jaccl/grow.py)."""
    next_look = time.monotonic() + WATCH_EVERY_S

    def look() -> None:
        nonlocal next_look
        now = time.monotonic()
        if now < next_look:
            return
        next_look = now + WATCH_EVERY_S
        for name, address in peers.items():
            if membership.refuses(address):
                raise PeerError(f"{who}: {name} died while {what} formed: its listener refuses connections")

    return look
