"""Forming the TCP mesh: a listener (TCP, or an abstract Unix socket for ranks of one host), the
addresses all-gathered, each rank connecting to its lower peers and accepting its higher ones
under the job's handshake, watched (a split, a shrink) until the deadline."""
from __future__ import annotations

import json
import socket
import time
from typing import Any, Callable

from ... import config
from ...errors import PeerError
from . import tcp
from .tcp import spin_seconds
from .tcp_mesh import TcpMeshTransport

PURPOSE_MESH = 0x4A4D  # "JM"
PURPOSE_SHRINK = 0x4A53  # "JS": shrink's agreement (membership.py) at a formed mesh's listener

Exchange = Callable[[bytes], list[bytes]]

WATCH_S = 0.1


def _in_slices(deadline: float, watch: Callable[[], None] | None, attempt: Callable[[float], Any]) -> Any:
    """attempt(deadline), or with watch: attempts with short deadlines, calling watch (which raises
    when the group being formed is abandoned) between them, until the real deadline."""
    if watch is None:
        return attempt(deadline)
    while True:
        watch()
        try:
            return attempt(min(deadline, time.monotonic() + WATCH_S))
        except PeerError:
            if time.monotonic() >= deadline:
                raise


def mesh_listener(host: str) -> tcp.Listener:
    """A listener for a mesh to form on (port 0: a free one). JACKLRING_LOCAL_TRANSPORT=unix:
    loopback peers connect through its abstract Unix socket, skipping the TCP/IP stack. Not by
    default: a peer that fails and exits breaks a Unix socket at once, so its neighbours may
    report the broken pipe instead of the mismatch that made it fail (TCP still takes their
    messages)."""
    return tcp.Listener(host, 0, local=config.get("JACKLRING_LOCAL_TRANSPORT") == "unix")


def connect_mesh(rank: int, size: int, peers: list[int], host: str, exchange: Exchange,
                 token: int, deadline: float, job: tcp.Auth,
                 watch: Callable[[], None] | None = None, listener: tcp.Listener | None = None) -> TcpMeshTransport:
    """Form the TCP mesh: every rank listens, the addresses are all-gathered with `exchange`
    (called exactly once, on every rank), then each rank connects to its lower peers and accepts
    its higher ones. Listening happens before the exchange, so no connect can arrive early.
    Every connection proves `job`'s key for job context `token` (tcp.connect / Listener).
    watch (a split, a shrink): called every WATCH_S while waiting; raises when a member is gone.
    listener: one from mesh_listener() whose address the caller already handed out (a shrink's
    join), else a new one. The transport keeps it open: shrink's agreement reaches this rank
    there (hellos of PURPOSE_SHRINK from any other rank)."""
    higher = {p for p in peers if p > rank}
    if listener is None:
        listener = mesh_listener(host)

    def admit(h: tcp.Hello) -> str | None:
        if h.purpose == PURPOSE_MESH and h.sender in higher and h.channel == 0:
            return None
        if h.purpose == PURPOSE_SHRINK and 0 <= h.sender < size and h.sender != rank:
            return None
        return f"not a mesh connection from a higher rank ({sorted(higher)}) nor a shrink of this group"

    listener.serve(job, token, rank, admit, f"rank {rank} (TCP mesh)")
    try:
        address = listener.where()
        blobs = exchange(json.dumps({"addr": address}).encode())
        everyone = [json.loads(blob)["addr"] for blob in blobs]
        addresses = {p: everyone[p] for p in peers}
        sockets: dict[int, socket.socket] = {}
        waiting: list[int] = []
        try:
            for p in peers:
                if p < rank:
                    hello = tcp.Hello(PURPOSE_MESH, rank, p, 0, token)
                    target = tcp.parse_address(addresses[p], f"rank {p}'s mesh address")
                    waiting = [p]
                    sockets[p] = _in_slices(deadline, watch, lambda until, target=target, hello=hello, p=p: tcp.connect(
                        target, hello, until, f"rank {p} (JACCL TCP mesh)", job))
            while higher - set(sockets):
                waiting = sorted(higher - set(sockets))
                sock, hello = _in_slices(deadline, watch, lambda until, waiting=waiting: listener.take(
                    lambda h: h.purpose == PURPOSE_MESH and h.sender not in sockets, until,
                    f"JACCL ranks {waiting} (TCP mesh, rank {rank})"))
                sockets[hello.sender] = sock
        except PeerError as exc:
            for s in sockets.values():
                s.close()
            if waiting:
                exc.mesh_rank = waiting[0]  # type: ignore[attr-defined]  # whom it connected to or waited for
            raise
        except BaseException:
            for s in sockets.values():
                s.close()
            raise
    except BaseException:
        listener.close()
        raise
    my_host = tcp.parse_address(address)[0]
    local_ranks = sum(1 for a in everyone if tcp.parse_address(a)[0] == my_host)
    labels = {p: f"rank {p} (JACCL TCP mesh, {addresses[p]})" for p in peers}
    return TcpMeshTransport(rank, size, sockets, labels=labels, spin_s=spin_seconds(local_ranks), listener=listener,
                            addresses=everyone)
