"""Where a JACCL newcomer finds the members: it knocks at MLX_JACCL_COORDINATOR, the one address
every JACCL process knows, and the member that recruits (the process of the job's first rank 0,
whose host that address names) listens there for the window of a grow() (the Door).

A knock is a connection with the authenticated handshake (transport/handshake.py) under the
job key, hello purpose PURPOSE_KNOCK, the newcomer's slot as sender, 0 as receiver: the Door
admits knocks for the vacant slots only, and the newcomer checks that the Door proves the job
key too, so neither side deals with an outsider. The frames after it are enrolment's
(elastic/enrolment.py: the recruiter invites, the newcomer accepts with the address of its
fresh mesh listener, the recruiter sends the decision or calls the attempt off), with the ends
reversed: here the newcomer connects.

Between grows the recruiter holds the coordinator address: the side channel's listener is not
closed when the group has formed but kept (hold()), and answers every knock's HELLO with
NOT_NOW ("no grow in progress"), before any proof, so another user cannot take the address
while the group lives and a newcomer hands nobody a proof; a grow's Door serves on that same
listener (reserve: the address is never released). A newcomer told NOT_NOW knocks again every
NOT_NOW_EVERY_S; one whose connection is refused (nothing listens: the job's first rank 0 is
gone, or not up yet) every KNOCK_EVERY_S; after a handshake that failed (another job, a wrong
secret, a slot not vacant) it waits REFUSED_EVERY_S, so it does not spend the Door's handshake
budget of its host.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

from ...errors import CollectiveTimeout, DistributedError, PeerError
from ..elastic import enrolment
from ..elastic.membership import Channel
from ..transport import holder, tcp
from ..transport.auth import Auth, secret_needed_across_hosts
from ..transport.handshake import ANSWER_TIMEOUT_S, NOT_NOW, HandshakeRetry, NotNow

log = logging.getLogger("jacklring.grow")

PURPOSE_KNOCK = 0x4A4B  # "JK": a newcomer at the coordinator address (the side channel is "JC")
KNOCK_EVERY_S = 0.05    # a newcomer knocks again this soon after a refused connection
REFUSED_EVERY_S = 0.5   # ... and this soon after a handshake that failed
NOT_NOW_EVERY_S = 0.1   # ... and this soon after the held address said "no grow in progress"

_held: dict[str, tcp.Listener] = {}  # coordinator address -> this process's listener held there
_held_lock = threading.Lock()


def hold(coordinator: str, listener: tcp.Listener, auth: Auth, token: int, rank: int) -> None:
    """Keep `listener` (bound at the coordinator address) for this process's grows: until the
    next Door, or a group formed again here (take_held), it refuses every knock with NOT_NOW at
    its HELLO (no proof crosses either way). It stays bound until the process ends."""
    def admit(hello: tcp.Hello) -> tuple[int, str]:
        return NOT_NOW, "no grow in progress"

    listener.reserve(auth, token, 0, admit, f"rank {rank} (JACCL coordinator, held between grows)")
    with _held_lock:
        old = _held.get(coordinator)
        _held[coordinator] = listener
    if old is not None and old is not listener:
        old.close()


def take_held(coordinator: str) -> tcp.Listener | None:
    """This process's listener held at the coordinator address (hold()), now the caller's, or None."""
    with _held_lock:
        return _held.pop(coordinator, None)


class Door:
    """The recruiter's listener at the coordinator address for one grow's window: it admits
    knocks of the job (under `auth`, job context `token`) for the slots in `vacant`."""

    def __init__(self, coordinator: str, auth: Auth, token: int, vacant: list[int], rank: int) -> None:
        host, port = tcp.parse_address(coordinator, "MLX_JACCL_COORDINATOR")
        self.where = coordinator
        self._token, self._rank = token, rank
        held = take_held(coordinator)  # the address this process kept since the group formed
        try:
            self._listener = held if held is not None else tcp.Listener(host, port, local=False)
        except PeerError as exc:
            raise DistributedError(f"rank {rank}: grow: newcomers knock at MLX_JACCL_COORDINATOR={coordinator}, "
                                   f"but this rank (the recruiter) cannot listen there: {exc}") from None
        self._auth = auth
        wanted = set(vacant)

        def admit(hello: tcp.Hello) -> str | None:
            if hello.purpose == PURPOSE_KNOCK and hello.sender in wanted and hello.channel == 0:
                return None
            return f"not a newcomer's knock for a vacant slot ({sorted(wanted)})"

        self._listener.reserve(auth, token, 0, admit, f"rank {rank} (JACCL grow, at the coordinator address)")

    def take(self, deadline: float) -> tuple[Channel, int] | None:
        """The next knock (its channel, the newcomer's slot), or None at the deadline. Without a
        job secret, a knock from another host is dropped (it would grow the group across hosts
        under a key anyone there can compute: jaccl/open_hosts.py); the newcomer refuses too."""
        while True:
            taken = self._listener.take(lambda h: h.purpose == PURPOSE_KNOCK, deadline, None)
            if taken is None:
                return None
            sock, hello = taken
            host = sock.getpeername()[0]
            if self._auth.secret or tcp.own_address(host) or not secret_needed_across_hosts():
                break
            log.warning("rank %d: grow: a knock for slot %d came from another host (%s) and no job secret is set: "
                        "dropped (set JACKLRING_SECRET or JACKLRING_SECRET_FILE on every rank)", self._rank,
                        hello.sender, host)
            sock.close()
        return Channel(sock, self._auth, hello.session, False, f"the newcomer at slot {hello.sender}"), hello.sender

    def rejected(self) -> str:
        """What the Door turned away (unauthenticated knocks), for the error of a grow that
        found too few newcomers; "" when nothing."""
        return self._listener.rejected_summary()

    def close(self) -> None:
        """The window ends; the address stays held for the next grow (hold())."""
        hold(self.where, self._listener, self._auth, self._token, self._rank)


def _foreign_listener(target: tuple[str, int]) -> str | None:
    """How another user's listener at target is described, when target is on this host and
    held by another uid (visible in /proc/net/tcp); None otherwise."""
    if not tcp.own_address(target[0]):
        return None
    held = holder.holder(*target)
    return None if held is None or held.uid == os.getuid() else held.describe()


def knock(coordinator: str, slot: int, auth: Auth, token: int, listen: Callable[[str], str],
          deadline: float) -> dict:
    """As the newcomer at `slot`: knock at the coordinator address until a recruiter takes this
    process in, and return the members' decision; CollectiveTimeout at the deadline, naming the
    address and the last reason a knock failed. listen(host): open this process's mesh
    listener on `host` (the address of this host that reaches the coordinator), if not yet
    open, and return its address, which the accept carries."""
    target = tcp.parse_address(coordinator, "MLX_JACCL_COORDINATOR")
    who = f"the JACCL coordinator (MLX_JACCL_COORDINATOR={coordinator})"
    last = "nothing listened there yet"
    refused = ""  # the last handshake that failed: what an outsider's process most needs to hear
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CollectiveTimeout(
                f"slot {slot}: no member of the group invited this process to join before the deadline: it knocked "
                f"at {who} every {KNOCK_EVERY_S:g} s, where the recruiter listens while the members call "
                f"Group.grow(); {last.lstrip('; ')}{'' if last.startswith('the last knock was refused') else refused}")
        squatter = _foreign_listener(target)
        if squatter is not None:
            # Another user's process listens at the coordinator address of this host: a knock
            # would hand it a proof. None is sent; the members' grow() cannot listen there either.
            last = (f"the coordinator address is {squatter}, not the group's recruiter: no knock was sent "
                    f"to it")
            time.sleep(min(KNOCK_EVERY_S, max(0.0, deadline - time.monotonic())))
            continue
        try:
            sock = socket.create_connection(target, timeout=min(1.0, remaining))
        except OSError as exc:
            last = f"the last knock found nothing listening ({exc.strerror or exc})"
            time.sleep(min(KNOCK_EVERY_S, max(0.0, deadline - time.monotonic())))
            continue
        try:
            address = listen(sock.getsockname()[0])
            hello = tcp.Hello(PURPOSE_KNOCK, slot, 0, 0, token).fresh()
            done = tcp.client_handshake(sock, hello, auth, coordinator, who, ANSWER_TIMEOUT_S, deadline)
        except HandshakeRetry:
            sock.close()
            time.sleep(min(KNOCK_EVERY_S, max(0.0, deadline - time.monotonic())))
            continue
        except NotNow:
            sock.close()
            last = "the last knock found the group's recruiter, with no grow in progress"
            time.sleep(min(NOT_NOW_EVERY_S, max(0.0, deadline - time.monotonic())))
            continue
        except (DistributedError, OSError) as exc:
            sock.close()
            last = f"the last knock was refused: {exc}"
            refused = f"; an earlier knock was refused: {exc}"
            time.sleep(min(REFUSED_EVERY_S, max(0.0, deadline - time.monotonic())))
            continue
        sock.settimeout(None)
        channel = Channel(sock, auth, done.session, True, who)
        decision, why = enrolment.answer_invitation(channel, 0, slot, {"addrs": [address]}, deadline)
        if decision is not None:
            return decision
        if why:
            last = why
