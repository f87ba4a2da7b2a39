"""Naming the rank that failed first when a collective fails on a ring of sockets.

A rank whose collective fails closes its ring links, so its neighbours fail next and the failure
travels around the ring. Each survivor used to blame the neighbour whose connection closed: with
three ranks and one killed, the second survivor could name the first, which was alive. So before
it closes its links a failing rank sends each live neighbour an abort notice: a connection that
passes the authenticated handshake with a hello of purpose PURPOSE_NOTICE whose channel field is
the rank it blames (-1: an error of its own, such as a deadline or a mismatch). A rank whose link
to P failed then names the rank in P's notice, or P itself when P's address refuses connections
(P died) or no notice came. The notice is passed on with the same culprit, hop by hop.

The notice has a connection of its own, never bytes in the ring's streams: bytes appended to a
stream could complete a message the neighbour still expects and be read as data. Groups on one
host pass the culprit in shared memory instead (local/shm.py, mark_broken).
"""
from __future__ import annotations

import socket
import threading
import time

from ...errors import DistributedError, PeerError
from ..transport import tcp
from .state import RingState

PURPOSE_NOTICE = 4  # 3 is taken by the formation's abort connections
NOTICE_WAIT_S = 0.5  # how long to wait for the notice of a neighbour that is still alive
RECHECK_S = 0.05     # meanwhile, how often to look whether it still listens (a killed process's
                     # listener can outlive its ring connections by a few milliseconds)
SEND_S = 0.3         # how long a failing rank spends delivering its notices, at most
PROBE_S = 0.2        # how long a connection attempt may take to say whether a peer still listens
# A notice's culprit of OUTER - q or below: rank q of the group whose hosts a leaders' ring links
# (hierarchy.py), a rank that is not in this ring.
OUTER = -2


def admits(sender: int, receiver: int, size: int) -> bool:
    return 0 <= sender < size and sender != receiver


def blame(ring: RingState, exc: BaseException) -> BaseException:
    """The error to raise for a failed collective: when a neighbour's connection failed, it
    names the rank that neighbour blamed. Sets `culprit` on the error (the rank blamed)."""
    if hasattr(exc, "culprit") or not isinstance(exc, PeerError):
        return exc
    peer = getattr(exc, "peer", None)  # the link that failed (set by the stream engine)
    if peer is None or peer == ring.rank:
        return exc
    notice = _notice_from(ring, peer)
    if notice is not None and notice <= OUTER:
        outer = OUTER - notice
        relayed = PeerError(f"rank {ring.rank}: {ring.what}: rank {outer} of the group that this ring links "
                            f"the hosts of died or failed (reported by rank {peer}, which closed its connection "
                            f"to this rank after that)")
        relayed.culprit, relayed.peer, relayed.outer_culprit = peer, peer, outer
        return relayed
    if notice is None or notice == peer:
        exc.culprit = peer  # it died, or could not say why it left
        return exc
    if notice < 0 or notice == ring.rank:
        own = PeerError(f"{exc}; rank {peer} reported that it gave up after an error of its own")
        own.culprit, own.peer = peer, peer
        return own
    relayed = PeerError(f"rank {ring.rank}: {ring.what}: rank {notice} died or failed (reported by "
                        f"rank {peer}, which closed its connection to this rank after that)")
    relayed.culprit, relayed.peer = notice, peer
    return relayed


def notify(ring: RingState, exc: BaseException) -> None:
    """Tell the live neighbours whom this rank blames, before its links close."""
    culprit = getattr(exc, "culprit", -1)
    skip = {culprit, getattr(exc, "peer", None), ring.rank}  # the dead, and who told us
    outer = getattr(exc, "outer_culprit", None)
    _send_notices(ring, culprit if outer is None else OUTER - outer, skip)


def notify_outer(ring: RingState, culprit: int) -> None:
    """On a leaders' ring (hierarchy.py): tell the live neighbours that this rank gives up because
    of rank `culprit` of the whole group (-1: an error of its own)."""
    _send_notices(ring, -1 if culprit < 0 else OUTER - culprit, {ring.rank})


def _send_notices(ring: RingState, culprit: int, skip: set) -> None:
    """Best effort, SEND_S at most in all: each notice goes on a thread of its own, and a
    neighbour that accepts but does not answer (a stopped process: the kernel accepts for it)
    is left to its thread, which the handshake's own timeout ends; the error is not held
    back for it."""
    deadline = time.monotonic() + SEND_S
    senders = [threading.Thread(target=_send_notice, args=(ring, q, culprit, deadline), daemon=True,
                                name=f"abort-notice-{q}")
               for q in sorted({link.peer for link in ring.right + ring.left} - skip)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(max(0.0, deadline - time.monotonic()))


def _send_notice(ring: RingState, q: int, culprit: int, deadline: float) -> None:
    address = ring.addresses[q][0]
    if not _listening(address):
        return  # gone (tcp.connect would retry until the deadline)
    hello = tcp.Hello(PURPOSE_NOTICE, ring.rank, q, culprit, ring.token)
    try:
        tcp.connect(tcp.parse_address(address), hello, deadline, f"rank {q}", ring.auth).close()
    except (DistributedError, OSError):
        pass  # it is gone too: its own neighbours will see that


def _notice_from(ring: RingState, peer: int) -> int | None:
    """The culprit in peer's abort notice; None when it sent none (it died, or cannot say)."""
    if not ring.listeners:
        return None
    match = lambda h: h.purpose == PURPOSE_NOTICE and h.sender == peer  # noqa: E731
    deadline = time.monotonic() + NOTICE_WAIT_S
    taken = ring.listeners[0].take(match, time.monotonic(), None)
    while taken is None:
        if time.monotonic() >= deadline or not _listening(ring.addresses[peer][0]):
            return None  # it died: no notice will come
        taken = ring.listeners[0].take(match, min(deadline, time.monotonic() + RECHECK_S), None)
    sock, hello = taken
    sock.close()
    return hello.channel


def _listening(address: str) -> bool:
    """Whether something still accepts connections at a peer's address (a killed process's
    listener refuses within milliseconds; an unreachable host counts as listening: no proof of
    death)."""
    host, port = tcp.parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=PROBE_S):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return True
