"""A newcomer joining a running group (grow()): the member that recruits it, and the newcomer
that waits to be recruited. The backend-neutral half; the ring's is ring/grow.py.

The newcomer listens at an address the members know (its slot) and waits. A member (the
recruiter) connects to it with the authenticated handshake (hello purpose `purpose`, the slot as
receiver). The handshake is mutual, so only a holder of the job key invites, and only a holder of
the job key is invited: an outsider that listens at the slot fails it and is passed over. The
frames after it are membership.Channel frames (each with a MAC):

    recruiter -> newcomer   invite     {"kind": "invite", "epoch": e, "timeout": t}
    newcomer  -> recruiter  accept     {"kind": "accept", "slot": s, "payload": {...}}
    recruiter -> newcomer   decision   {"kind": "decision", ...}, or {"kind": "cancel", "why": ...}

After a cancellation (the members did not find every newcomer they wanted) the newcomer waits
for the next invitation, until its own deadline. So does a newcomer whose recruiter sends no
decision within the invite's timeout (how long the recruiter looks for newcomers) and
DECISION_GRACE_S: the recruiter stopped or stalled, and the newcomer says so at once.
"""
from __future__ import annotations

import json
import logging
import socket
import time
from typing import Protocol

import numpy as np

from ...errors import CollectiveTimeout, ConfigError, DistributedError, PeerError
from ..transport import tcp
from ..transport.auth import Auth
from ..transport.handshake import HandshakeRetry
from .membership import Channel

log = logging.getLogger("jacklring.grow")

DECISION_GRACE_S = 5.0  # beyond the recruiter's search timeout, how long an accepted newcomer waits for its decision
ADDRESS_BYTES = 4096    # one member's fresh listener addresses, as JSON, in gather_addresses


class Members(Protocol):
    """What the members' side of grow() asks of their group: its collectives on numpy arrays."""

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def all_gather(self, src: np.ndarray, dst: np.ndarray) -> None: ...

    def broadcast(self, buf: np.ndarray, root: int) -> None: ...


def group_key(origin_auth: Auth, nonce: bytes, epoch: int) -> Auth:
    """The grown group's key: from the job key, so a newcomer (which holds only that) can compute
    it once told the nonce, and nobody who was not told can."""
    return origin_auth.derive(b"jacklring-grow-group\0" + nonce + str(epoch).encode())


def gather_addresses(group: Members, mine: list[str]) -> list[list[str]]:
    """Every member's fresh listener addresses, by rank (an all_gather over the members' group)."""
    text = json.dumps(mine).encode()
    if len(text) > ADDRESS_BYTES:
        raise ConfigError(f"rank {group.rank()}: grow: {len(text)} bytes of listener addresses (at most "
                          f"{ADDRESS_BYTES})")
    src = np.zeros(ADDRESS_BYTES, np.uint8)
    src[:len(text)] = np.frombuffer(text, np.uint8)
    dst = np.zeros(ADDRESS_BYTES * group.size(), np.uint8)
    group.all_gather(src, dst)
    return [json.loads(dst[i * ADDRESS_BYTES:(i + 1) * ADDRESS_BYTES].tobytes().rstrip(b"\0"))
            for i in range(group.size())]


def broadcast_decision(group: Members, decision: dict) -> dict:
    """Rank 0's decision on every member (a length, then the JSON, broadcast over their group)."""
    text = json.dumps(decision).encode() if group.rank() == 0 else b""
    length = np.array([len(text)], np.int64)
    group.broadcast(length, 0)
    buf = np.zeros(int(length[0]), np.uint8)
    if group.rank() == 0:
        buf[:] = np.frombuffer(text, np.uint8)
    group.broadcast(buf, 0)
    return json.loads(buf.tobytes())


def recruit(address: str, slot: int, auth: Auth, token: int, purpose: int, sender: int, epoch: int,
            answer_timeout: float, search_timeout: float) -> tuple[Channel, dict] | str:
    """Invite the newcomer listening at `address` as `slot`: its channel and what it accepted
    with, or why not (nobody listens there yet, it did not answer, or it failed the handshake).
    search_timeout: how long the recruiter may look for other newcomers before it decides (the
    newcomer waits that long, and DECISION_GRACE_S, for the decision)."""
    who = f"the newcomer at slot {slot} ({address})"
    try:
        sock = socket.create_connection(tcp.parse_address(address), timeout=answer_timeout)
    except ConnectionRefusedError:
        return "nobody listens there"
    except OSError as exc:
        return f"could not connect ({exc.strerror or exc})"
    try:
        hello = tcp.Hello(purpose, sender, slot, 0, token).fresh()
        done = tcp.client_handshake(sock, hello, auth, address, who, answer_timeout)
    except HandshakeRetry as exc:
        sock.close()
        return f"it closed the connection ({exc})"
    except (DistributedError, OSError) as exc:
        sock.close()
        return f"it was refused: {exc}"
    sock.settimeout(None)
    return invite(Channel(sock, auth, done.session, True, who), slot, epoch, answer_timeout, search_timeout)


def invite(channel: Channel, slot: int, epoch: int, answer_timeout: float,
           search_timeout: float) -> tuple[Channel, dict] | str:
    """On an authenticated connection to the newcomer at `slot` (whichever end connected):
    invite it; its channel and what it accepted with, or why not (the channel is then closed)."""
    try:
        deadline = time.monotonic() + answer_timeout
        channel.send({"kind": "invite", "epoch": epoch, "timeout": search_timeout}, deadline)
        accept = channel.recv(deadline)
    except (DistributedError, OSError) as exc:
        channel.close()
        return f"it was refused: {exc}"
    if accept.get("kind") != "accept" or accept.get("slot") != slot or not isinstance(accept.get("payload"), dict):
        channel.close()
        return f"it answered {accept.get('kind')!r} for slot {accept.get('slot')!r}, not an accept for slot {slot}"
    return channel, accept["payload"]


def await_invitation(listener: tcp.Listener, auth: Auth, slot: int, purpose: int, payload: dict,
                     deadline: float) -> dict:
    """As the newcomer at `slot` (listener serving `purpose` hellos addressed to it under `auth`): wait for a
    member's invitation, accept with `payload`, and return the members' decision. Waits through
    cancelled attempts; CollectiveTimeout at the deadline."""
    cancelled = ""
    while True:
        taken = listener.take(lambda h: h.purpose == purpose, deadline, None)
        if taken is None:
            raise CollectiveTimeout(
                f"slot {slot}: no member of the group invited this process to join before the deadline (it "
                f"listened at {listener.where()}; the members call Group.grow() to take it in){cancelled}")
        sock, hello = taken
        channel = Channel(sock, auth, hello.session, False, f"rank {hello.sender} of the group")
        decision, why = answer_invitation(channel, hello.sender, slot, payload, deadline)
        if decision is not None:
            return decision
        if why:
            cancelled = why


def answer_invitation(channel: Channel, sender: int, slot: int, payload: dict,
                      deadline: float) -> tuple[dict | None, str]:
    """As the newcomer at `slot`, on an authenticated connection to rank `sender` (the
    recruiter; whichever end connected): take its invitation, accept with `payload` and wait
    for the decision; closes the channel. (the decision, "") or (None, why this attempt came to
    nothing, for the error at the newcomer's deadline; "" when nothing worth saying)."""
    search = None  # how long the recruiter searches, once it invited
    try:
        invitation = channel.recv(deadline)
        if invitation.get("kind") != "invite":
            raise PeerError(f"rank {sender} sent {invitation.get('kind')!r}, not an invitation")
        channel.send({"kind": "accept", "slot": slot, "payload": payload}, deadline)
        search = float(invitation.get("timeout", 0.0))
        told_by = min(deadline, time.monotonic() + search + DECISION_GRACE_S)
        answer = channel.recv(told_by)
    except CollectiveTimeout as exc:
        if search is None:  # this process's own deadline passed during the invitation
            return None, ""
        if time.monotonic() < deadline:
            log.warning("slot %d: rank %d (the recruiter of a grow) invited this process, then sent no decision "
                        "within %g s: it stopped or stalled; waiting for the next invitation", slot, sender,
                        search + DECISION_GRACE_S)
        return None, (f"; rank {sender} (the recruiter) invited it, then sent no decision within {search:g} s + "
                      f"{DECISION_GRACE_S:g} s: it stopped or stalled ({exc})")
    except DistributedError as exc:
        log.debug("slot %d: an invitation from rank %d broke off: %s", slot, sender, exc)
        return None, ""
    finally:
        channel.close()
    if answer.get("kind") == "decision":
        return answer, ""
    log.debug("slot %d: rank %d called the grow off: %s", slot, sender, answer.get("why"))
    return None, f"; the last attempt was called off: {answer.get('why')}"


def tell(channel: Channel, message: dict, deadline: float) -> str | None:
    """Send the decision (or the cancellation) and close; why it failed, or None."""
    try:
        channel.send(message, deadline)
        return None
    except DistributedError as exc:
        return str(exc)
    finally:
        channel.close()
