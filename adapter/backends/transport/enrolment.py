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

import logging
import socket
import time

from ...errors import CollectiveTimeout, DistributedError, PeerError
from . import tcp
from .auth import Auth
from .handshake import HandshakeRetry
from .membership import Channel

log = logging.getLogger("jacklring.grow")

DECISION_GRACE_S = 5.0  # beyond the recruiter's search timeout, how long an accepted newcomer waits for its decision


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
        sock.settimeout(None)
        channel = Channel(sock, auth, done.session, True, who)
        deadline = time.monotonic() + answer_timeout
        channel.send({"kind": "invite", "epoch": epoch, "timeout": search_timeout}, deadline)
        accept = channel.recv(deadline)
    except HandshakeRetry as exc:
        sock.close()
        return f"it closed the connection ({exc})"
    except (DistributedError, OSError) as exc:
        sock.close()
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
        search = None  # how long the recruiter searches, once it invited
        try:
            invite = channel.recv(deadline)
            if invite.get("kind") != "invite":
                raise PeerError(f"rank {hello.sender} sent {invite.get('kind')!r}, not an invitation")
            channel.send({"kind": "accept", "slot": slot, "payload": payload}, deadline)
            search = float(invite.get("timeout", 0.0))
            told_by = min(deadline, time.monotonic() + search + DECISION_GRACE_S)
            answer = channel.recv(told_by)
        except CollectiveTimeout as exc:
            if search is None:  # this process's own deadline passed during the invitation
                continue
            cancelled = (f"; rank {hello.sender} (the recruiter) invited it, then sent no decision within "
                         f"{search:g} s + {DECISION_GRACE_S:g} s: it stopped or stalled ({exc})")
            if time.monotonic() < deadline:
                log.warning("slot %d: rank %d (the recruiter of a grow) invited this process, then sent no decision "
                            "within %g s: it stopped or stalled; waiting for the next invitation", slot, hello.sender,
                            search + DECISION_GRACE_S)
            continue
        except DistributedError as exc:
            log.debug("slot %d: an invitation from rank %d broke off: %s", slot, hello.sender, exc)
            continue
        finally:
            channel.close()
        if answer.get("kind") == "decision":
            return answer
        cancelled = f"; the last attempt was called off: {answer.get('why')}"
        log.debug("slot %d: rank %d called the grow off: %s", slot, hello.sender, answer.get("why"))


def tell(channel: Channel, message: dict, deadline: float) -> str | None:
    """Send the decision (or the cancellation) and close; why it failed, or None."""
    try:
        channel.send(message, deadline)
        return None
    except DistributedError as exc:
        return str(exc)
    finally:
        channel.close()
