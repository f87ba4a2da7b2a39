"""Naming the rank that failed first when a collective fails on a ring of sockets.

A rank whose collective fails closes its ring links, so its neighbours fail next and the failure
travels around the ring. Each survivor used to blame the neighbour whose connection closed: with
three ranks and one killed, the second survivor could name the first, which was alive. So before
it closes its links a failing rank sends each live neighbour an abort notice: a connection that
passes the authenticated handshake with a hello of purpose PURPOSE_NOTICE whose channel field is
the rank it blames (-1: an error of its own, such as a deadline or a mismatch). A rank whose link
to P failed then names the rank in P's notice, or P itself when P's address refuses connections
(P died) or no notice came. The notice is passed on with the same culprit, hop by hop.

A deadline is different: when one rank stops (SIGSTOP, swapped out) or never calls the
operation, every rank of the ring soon waits for another and all their deadlines fire within
moments of each other, so each used to blame whom it waited for, often a live rank. So a rank
whose operation timed out first tells the ranks that may wait for it that it is stuck too (a
notice naming -1), then listens STUCK_WAIT_S for the ranks it waits for: one that says nothing
is the culprit (a stopped process cannot, a rank outside the operation does not); when all say
they are stuck, a rank nearer the silent one names it soon after, and that name is adopted.

The notice has a connection of its own, never bytes in the ring's streams: bytes appended to a
stream could complete a message the neighbour still expects and be read as data. Groups on one
host pass the culprit in shared memory instead (local/segment.py, mark_broken).
"""
from __future__ import annotations

import socket
import threading
import time

from ...errors import (
    DEADLINE,
    NOTICE,
    CollectiveTimeout,
    DistributedError,
    MismatchError,
    PeerError,
    failure_of,
    with_failure,
)
from ..transport import blame as rule
from ..transport import tcp
from ..transport.blame import MISMATCH, MISMATCH_SPAN, OUTER, RELAY_WAIT_S, STUCK_WAIT_S
from .state import RingState

PURPOSE_NOTICE = 4  # 3 is taken by the formation's abort connections
NOTICE_WAIT_S = 0.5  # how long to wait for the notice of a neighbour that is still alive
RECHECK_S = 0.05     # meanwhile, how often to look whether it still listens (a killed process's
                     # listener can outlive its ring connections by a few milliseconds)
SEND_S = 0.3         # how long a failing rank spends delivering its notices, at most
ARRIVING_S = 0.05    # at the end of the window, how long to wait for a notice still in its handshake
PROBE_S = 0.2        # how long a connection attempt may take to say whether a peer still listens
STANDBY_POLL_S = 0.01  # after a deadline, how often the standby connections are read (standby.py)
# The culprit codes a notice's channel field carries, the rule for whom a deadline blames and
# the relayed verdict's words are the transport's (transport/blame.py, shared with JACCL's mesh):
# MISMATCH + a * MISMATCH_SPAN + b, ranks a and b called different collectives; OUTER - q, rank
# q of the group whose hosts a leaders' ring links (local/staged.py); -1, an error of its own.


def admits(sender: int, receiver: int, size: int) -> bool:
    return 0 <= sender < size and sender != receiver


def from_ring_links(exc: BaseException) -> bool:
    """Whether a failure came from the ring's socket links (the stream engine marks its errors),
    also in a group that otherwise runs over shared memory (a split's records cross the links)."""
    failure = failure_of(exc)
    return failure.waiting_on is not None or (isinstance(exc, PeerError) and failure.peer is not None
                                              and failure.culprit is None)


def blame(ring: RingState, exc: BaseException) -> BaseException:
    """The error to raise for a failed collective: when a neighbour's connection failed, it
    names the rank that neighbour blamed; at a deadline, the rank that went silent. Sets
    the culprit in the error's failure record (the rank blamed)."""
    failure = failure_of(exc)
    if isinstance(exc, CollectiveTimeout) and failure.culprit is None:
        neighbours = {link.peer for link in ring.right + ring.left}
        return blame_silence(ring, exc, failure.waiting_on or (), neighbours)
    if failure.culprit is not None or not isinstance(exc, PeerError):
        return exc
    peer = failure.peer  # the link that failed (set by the stream engine)
    if peer is None or peer == ring.rank:
        return exc
    notice = _notice_from(ring, peer)
    if notice is not None and notice >= MISMATCH:
        return _mismatch_seen(ring, exc, notice, peer)
    if notice is not None and notice <= OUTER:
        outer = OUTER - notice
        relayed = PeerError(f"rank {ring.rank}: {ring.what}: rank {outer} of the group that this ring links "
                            f"the hosts of died or failed (reported by rank {peer}, which closed its connection "
                            f"to this rank after that)")
        return with_failure(relayed, culprit=peer, peer=peer, outer_culprit=outer, how=NOTICE)
    if notice is None or notice == peer:
        return with_failure(exc, culprit=peer)  # it died, or could not say why it left
    if notice == ring.rank:
        # peer blames this rank: it waited for it past its deadline (this process was stopped or
        # starved, and has just resumed). Naming peer would get a live rank excluded, naming
        # itself would make shrink(exclude=[culprit]) return None: it names nobody, and learns
        # from the agreement whether the others carried on without it.
        own = PeerError(f"{exc}; rank {peer} gave up waiting for this rank (rank {ring.rank}): this process was "
                        f"stopped or too slow, and the others may have carried on without it")
        return with_failure(own, culprit=-1, peer=peer, how=NOTICE)
    if notice < 0:
        # peer hit a deadline or an error of its own: it was waiting for someone, perhaps this
        # rank, and is alive (it spoke). Naming it would get a live rank excluded: name nobody.
        own = PeerError(f"{exc}; rank {peer} reported that it gave up after a deadline or an error of its own "
                        f"(if this process was stopped, the others may have carried on without it)")
        return with_failure(own, culprit=-1, peer=peer, how=NOTICE)
    return rule.relay_error(f"rank {ring.rank}: {ring.what}: ", notice, peer)


def blame_silence(ring: RingState, exc: BaseException, waited, tell: set) -> BaseException:
    """A deadline passed while this rank waited for the ranks `waited`: find the silent one (see
    the module's docstring). `tell`: the ranks that may be waiting for this one."""
    me = ring.rank
    waited = [q for q in waited if q != me]
    if not waited or not ring.listeners:
        return exc
    start = time.monotonic()
    _send_notices(ring, -1, {me}, sorted(tell - {me}), wait=False)  # "stuck too"
    heard: dict[int, float | None] = {}  # sender -> when it said it is stuck; None: it named a rank
    listener = ring.listeners[0]
    standby = ring.standby  # the words of the ranks waited for, without a handshake (standby.py)
    match = lambda h: h.purpose == PURPOSE_NOTICE and h.sender in waited  # noqa: E731

    def word(sender: int, channel: int) -> BaseException | None:
        """What a notice from `sender` saying `channel` means: None while it says it is stuck."""
        if channel == -1 or channel == me:
            heard.setdefault(sender, time.monotonic())
            return None
        heard[sender] = None
        if channel >= MISMATCH:
            return _mismatch_seen(ring, exc, channel, sender)
        return _relayed(exc, channel, sender)

    until = start + STUCK_WAIT_S
    named: BaseException | None = None
    while named is None:
        for sender, channel in standby.words(waited) if standby is not None else ():
            named = named or word(sender, channel)
        if named is not None:
            break
        now = time.monotonic()
        if now >= until:
            silent = rule.silent_rank(waited, set(heard))
            if silent is not None and until < start + RELAY_WAIT_S and silent in listener.arriving(PURPOSE_NOTICE):
                until = min(now + ARRIVING_S, start + RELAY_WAIT_S)  # its notice is in its handshake
                continue
            if silent is not None:
                named = _silent(exc, silent, STUCK_WAIT_S)
            elif until >= start + RELAY_WAIT_S:
                named = blaming_text(exc, waited[0], f"{exc}; every rank it waited for was stuck too, "
                                                     f"and none named another rank")
            until = start + RELAY_WAIT_S
            continue
        taken = listener.take(match, until if standby is None else min(until, now + STANDBY_POLL_S), None)
        if taken is None:
            continue
        sock, hello = taken
        sock.close()
        named = word(hello.sender, hello.channel)
    # What the ranks this one tells have said meanwhile: one that named a rank needs no verdict
    # from this one, one that is stuck listens only until its own window closes (notify).
    told = lambda h: h.purpose == PURPOSE_NOTICE and h.sender in tell  # noqa: E731
    said = standby.words(tell) if standby is not None else []
    while (taken := listener.take(told, time.monotonic(), None)) is not None:
        taken[0].close()
        said.append((taken[1].sender, taken[1].channel))
    for sender, channel in said:
        if channel == -1 or channel == me:
            heard.setdefault(sender, time.monotonic())
        else:
            heard[sender] = None
    named.heard = heard  # type: ignore[attr-defined]
    return named


def blame_p2p(ring: RingState, exc: BaseException, peer: int, partners: set[int]) -> BaseException:
    """A send to / recv from `peer` failed: the error names the rank at fault (peer, or the rank
    peer blamed before it gave up, or the silent rank behind a deadline), and the ranks this one
    exchanges messages with are told, since they may be waiting for it."""
    if failure_of(exc).culprit is not None or not isinstance(exc, (PeerError, CollectiveTimeout)):
        return exc
    # Who may wait for this rank: those it exchanges messages with, `partners` (telling all
    # n - 1 ranks costs a handshake each, too slow for the deadline's window on a loaded host).
    partners = (set(partners) | {peer}) - {ring.rank}
    if isinstance(exc, CollectiveTimeout):
        named = blame_silence(ring, exc, [peer], partners)
    elif getattr(exc, "unanswered", False):
        # peer's acceptor left this rank's handshake unanswered until the deadline: peer is
        # stopped (or starved), and no notice will come from it (blame() would wait NOTICE_WAIT_S).
        named = blaming_text(exc, peer, f"{exc}; rank {peer} is the rank that went silent: its process answered "
                                        f"no connection for the whole deadline (it is stopped, or starved of CPU)")
    else:
        named = blame(ring, with_failure(exc, peer=peer))
    failure = failure_of(named)
    culprit = failure.culprit
    if culprit is not None:
        outer = failure.outer_culprit
        _send_notices(ring, culprit if outer is None else OUTER - outer,
                      {culprit, failure.peer, ring.rank}, partners,
                      heard=getattr(named, "heard", None))
    return named


def _silent(exc: BaseException, culprit: int, waited_s: float) -> BaseException:
    return blaming_text(exc, culprit, f"{exc}; {rule.silence_text(culprit, waited_s)}")


def _relayed(exc: BaseException, culprit: int, reporter: int) -> BaseException:
    if culprit <= OUTER:
        return blaming_text(exc, reporter, f"{exc}; rank {OUTER - culprit} of the group that this ring links "
                                           f"the hosts of went silent (reported by rank {reporter})",
                            outer=OUTER - culprit)
    return blaming_text(exc, culprit, f"{exc}; rank {culprit} is the rank that went silent (reported by "
                                      f"rank {reporter}, which waited for it)", peer=reporter)


def blaming_text(exc: BaseException, culprit: int, text: str, peer: int | None = None,
                 outer: int | None = None) -> BaseException:
    """An error of exc's type with `text`, blaming `culprit`."""
    try:
        named = type(exc)(text)
    except TypeError:
        named = CollectiveTimeout(text)
    return with_failure(named, culprit=culprit, peer=culprit if peer is None else peer, outer_culprit=outer,
                        how=DEADLINE if isinstance(named, CollectiveTimeout) else NOTICE)


def mismatch(rank: int, other: int, text: str) -> MismatchError:
    """The MismatchError of ranks `rank` and `other` disagreeing (notify passes the pair on)."""
    error = MismatchError(text)
    error.between = (min(rank, other), max(rank, other))  # type: ignore[attr-defined]
    return error


def _mismatch_seen(ring: RingState, exc: BaseException, code: int, peer: int) -> MismatchError:
    a, b = rule.mismatch_pair(code)  # type: ignore[misc]
    seen = MismatchError(f"rank {ring.rank}: {ring.what}: ranks {a} and {b} called different collectives "
                         f"(a collective mismatch, reported by rank {peer}, which gave up after that; "
                         f"their MismatchErrors name both requests)")
    seen.between = (a, b)  # type: ignore[attr-defined]
    seen.__cause__ = exc
    return with_failure(seen, peer=peer, how=NOTICE)  # type: ignore[return-value]


def notify(ring: RingState, exc: BaseException) -> None:
    """Tell the live neighbours whom this rank blames, before its links close."""
    between = getattr(exc, "between", None)
    if between is not None and max(between) < MISMATCH_SPAN:
        _send_notices(ring, rule.mismatch_code(*between), {ring.rank, failure_of(exc).peer})
        return
    failure = failure_of(exc)
    culprit = -1 if failure.culprit is None else failure.culprit
    skip = {culprit, failure.peer, ring.rank}  # the dead, and who told us
    outer = failure.outer_culprit
    _send_notices(ring, culprit if outer is None else OUTER - outer, skip, heard=getattr(exc, "heard", None))


def notify_outer(ring: RingState, culprit: int) -> None:
    """On a leaders' ring (local/staged.py): tell the live neighbours that this rank gives up because
    of rank `culprit` of the whole group (-1: an error of its own)."""
    _send_notices(ring, -1 if culprit < 0 else OUTER - culprit, {ring.rank})


def _send_notices(ring: RingState, culprit: int, skip: set, to=None, wait: bool = True,
                  heard: dict[int, float | None] | None = None) -> None:
    """Best effort, SEND_S at most in all: each notice goes on a thread of its own, and a
    neighbour that accepts but does not answer (a stopped process: the kernel accepts for it;
    one that is exiting) is left to its thread, which the handshake's own timeout ends; the
    error is not held back for it. `to`: the ranks to tell (default: the ring neighbours);
    wait=False: do not wait for the deliveries at all. heard (blame_silence's, after a
    deadline): a rank that named a rank itself is not told; one that said it is stuck listens
    for a verdict only until its own window closes, RELAY_WAIT_S after it spoke, so the error
    is held for it no longer than that."""
    now = time.monotonic()
    deadline = now + SEND_S
    heard = heard or {}
    targets = {link.peer for link in ring.right + ring.left} if to is None else set(to)
    targets -= skip | {q for q, said in heard.items() if said is None}
    until = {q: deadline if heard.get(q) is None else max(now, min(deadline, heard[q] + RELAY_WAIT_S))  # type: ignore[operator]
             for q in targets}
    # At once, on the connections made for it (standby.py): a rank told there is not waited for.
    told = ring.standby.say(culprit, targets) if ring.standby is not None else set()
    senders = [(threading.Thread(target=_send_notice, args=(ring, q, culprit, until[q]), daemon=True,
                                 name=f"abort-notice-{q}"), q)
               for q in sorted(targets)]
    for sender, _ in senders:
        sender.start()
    for sender, q in senders if wait else ():
        if q in told:
            continue
        sender.join(max(0.0, until[q] - time.monotonic()))


def _send_notice(ring: RingState, q: int, culprit: int, deadline: float) -> None:
    address = ring.addresses[q][0]
    hello = tcp.Hello(PURPOSE_NOTICE, ring.rank, q, culprit, ring.token)
    try:
        # One attempt: a rank whose listener refuses has left, and needs no notice.
        tcp.connect_with_hello(tcp.parse_address(address), hello, deadline, f"rank {q}", ring.auth,
                               retry=False)[0].close()
    except (DistributedError, OSError):
        pass  # it is gone too: its own neighbours will see that


def _notice_from(ring: RingState, peer: int) -> int | None:
    """The culprit in peer's abort notice (a handshake notice, or its word on a standby
    connection); None when it sent none (it died, or cannot say)."""
    if not ring.listeners:
        return None
    standby = ring.standby
    match = lambda h: h.purpose == PURPOSE_NOTICE and h.sender == peer  # noqa: E731

    def said() -> list[int]:
        """What peer said so far, in either way, consumed."""
        codes = [code for _, code in standby.words([peer])] if standby is not None else []
        while (taken := ring.listeners[0].take(match, time.monotonic(), None)) is not None:
            taken[0].close()
            codes.append(taken[1].channel)
        return codes

    def last_said() -> list[int]:
        """What peer said, once the standby connection to it (if one is being made) is filed and
        its notice, if one is in its handshake, is queued: the listener acknowledges a notice
        before its acceptor files it, so peer may have left (and refuse) with its notice still
        arriving here; reading none then named peer, alive or not (issue #48: a live rank in
        1 trial of 25 of the split cells over shared memory)."""
        if standby is not None:
            standby.settle(peer, time.monotonic() + NOTICE_WAIT_S)
        codes = said()
        until = time.monotonic() + NOTICE_WAIT_S
        while not codes and peer in ring.listeners[0].arriving(PURPOSE_NOTICE) and time.monotonic() < until:
            taken = ring.listeners[0].take(match, min(until, time.monotonic() + RECHECK_S), None)
            if taken is not None:
                taken[0].close()
                codes.append(taken[1].channel)
            codes += said()
        return codes
    deadline = time.monotonic() + NOTICE_WAIT_S
    probed = 0.0
    codes = said()
    while not codes:
        now = time.monotonic()
        if now >= deadline:
            codes = last_said()
            if not codes:
                return None
            break
        if now >= probed + RECHECK_S:
            probed = now
            if not _listening(ring.addresses[peer][0]):
                codes = last_said()  # it may have spoken just before it left
                if not codes:
                    return None  # it died: no notice will come
                break
        poll = STANDBY_POLL_S if standby is not None else RECHECK_S
        taken = ring.listeners[0].take(match, min(deadline, now + poll), None)
        if taken is not None:
            taken[0].close()
            codes.append(taken[1].channel)
        codes += said()
    # A rank that timed out first said it was stuck (-1), then whom it blames: take the last word.
    named = [code for code in codes if code != -1]
    return named[-1] if named else -1


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
