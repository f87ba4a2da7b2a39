"""shrink()'s backend-neutral loop, around the agreement (membership.py): every socket backend
that can shrink (the ring, JACCL on the TCP mesh) runs it and passes in only how it listens and
how it forms a group of the survivors.

Each attempt opens fresh listeners, agrees (their addresses travel in this rank's join), breaks
the old group's links (an operation still in flight there fails at once) and forms the new group
on the fresh listeners, under a key of the decision alone (Decision.key: an excluded rank, or
anyone who was not told the decision, cannot connect to it). A death during that formation (after
the decision) fails it on a member, perhaps not on every one: that member agrees again, with a
higher epoch (a few times at most), as a member of the group that did not form, at that group's
first listener, where a member on which it did form finds it when it shrinks that group. Once a
rank has a decision, its listener of the group it leaves answers later joins with the outcome
(Tombstone), so a rank that was only stopped learns that it was excluded. rejoin() runs the same
loop for a rank on which a group formed otherwise (grow's) did not form. The seats kept in groups
that did not form close with the group this rank ends in (release(), from its close()).
"""
from __future__ import annotations

import logging
import time
import weakref
from typing import Callable, Sequence, TypeVar

from ...errors import DistributedError, PeerError, QuorumError, blaming
from ..transport import tcp
from ..transport.auth import Auth
from ..transport.handshake import ANSWER_TIMEOUT_S
from . import membership

log = logging.getLogger("jacklring.shrink")

MAX_ATTEMPTS = 3      # agreements in one shrink() (each after a death during the last formation)

Group = TypeVar("Group")

_epochs: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_tombstones: "weakref.WeakKeyDictionary[object, membership.Tombstone]" = weakref.WeakKeyDictionary()
# The seats of groups that did not form, and their tombstones, that a group's close() closes.
_kept: "weakref.WeakKeyDictionary[object, list[tuple[list[tcp.Listener], list[membership.Tombstone]]]]" = \
    weakref.WeakKeyDictionary()


def epoch_of(group: object) -> int:
    """The epoch of the shrink or grow that formed this group (0 for a group formed at init or by split)."""
    return _epochs.get(group, 0)


def record_epoch(group: object, epoch: int) -> None:
    _epochs[group] = epoch


def shrink(old: object, seat: membership.Seat, size: int, listen: Callable[[], list[tcp.Listener]],
           form: Callable[[membership.Seat, membership.Decision, list[int], list[tcp.Listener], float], Group],
           token: Callable[[membership.Seat, membership.Decision], int], break_links: Callable[[str], None],
           exclude: Sequence[int], min_size: int | None, timeout: float) -> tuple[Group, list[int]]:
    """The survivors' group (see the module docstring), as this rank's new group, and its members
    as ranks of `old`. listen(): fresh listeners (their addresses are this rank's join payload,
    "addrs"); form(seat, decision, members, listeners, connect_timeout): the group the decision
    names (its members: ranks of `old`) on the listeners (none for a group of one), raising
    DistributedError when a member failed meanwhile (seat: where this rank agreed, its rank and
    key those of the group the decision is about); token(seat, decision): the job context id
    that group's listeners admit (a hello's token); break_links(why): fail the old group's
    operations at once.

    A formation that failed on this rank may have finished on another (a death inside its
    closing step ends it one way here and the other way there), which then treats the group as
    formed and, at its first failed collective, shrinks it. So after a failed formation this rank
    does the same: it agrees again as a member of the group that did not form, at that group's
    first listener, kept open for it (its seat), and never again on the group it came from."""
    return _loop(old, seat, size, listen, form, token, break_links, exclude, min_size, timeout, epoch_of(old) + 1,
                 None, None)


def rejoin(predecessor: object | None, seat: membership.Seat, size: int, listen: Callable[[], list[tcp.Listener]],
           form: Callable[[membership.Seat, membership.Decision, list[int], list[tcp.Listener], float], Group],
           token: Callable[[membership.Seat, membership.Decision], int], break_links: Callable[[str], None],
           timeout: float, epoch: int, decided: Callable[[membership.Decision], None]) -> tuple[Group, list[int]]:
    """After a group that was not formed by shrink() (grow's) failed to form on this rank: agree
    as a member of it, at `seat` (unformed_seat(): its first listener, held), where a member on
    which it did form meets this rank when it shrinks it, and form the group the agreement names
    (shrink()'s loop from there on). Returns it and its members, as ranks of the group that did
    not form. This rank's join says that the group did not form here ("unformed"), so
    decided(decision), called on the first decision before this rank acts on it, can tell
    whether any member of it formed that group; it may raise to stop here (grow: nobody did, so
    the members keep the group they had), and the seat then answers later joins with that
    decision until `predecessor` is closed (at once when None). break_links(why) is called once
    this rank carries on (decided() passed). epoch: that of the group that did not form. A
coordinator here takes any number of members (min_size 1): going back needs no quorum, so
decided() applies the quorum for carrying on (a coordinator on which the group formed, in its
own shrink(), applies its min_size as ever)."""
    return _loop(predecessor, seat, size, listen, form, token, break_links, [], 1, timeout, epoch + 1,
                 decided, seat.listener)


class _NobodyFormed(PeerError):
    """The agreement after a grown group failed to form found that it formed on no member."""


def after_grow_failure(where: str, seat: membership.Seat, size: int, parts: tuple, old: object | None,
                       break_old: Callable[[str], None] | None, timeout: float, epoch: int, why: str,
                       culprit: int | None) -> tuple[Group, list[int]]:
    """A group of `size` that grow() formed (epoch `epoch`) did not form on this rank, a member
    (whose group before the grow is `old`, failed at once by break_old) or a newcomer (old and
    break_old None): a rank died or stopped after the decision. It may have formed on another
    rank all the same (a death inside its closing step ends the formation one way here and the
    other way there), which will shrink it at its first failed collective. So this rank agrees,
    as shrink() does after a failed formation, as a member of the grown group at `seat`
    (unformed_seat(): its first listener, held): with the others on which it failed at once, with
    those on which it formed when they shrink it. If any member of the outcome formed the grown
    group, every one of them forms the group of the outcome (parts: shrink()'s listen, form and
    token for this backend) and this rank returns it, with its members as ranks of the grown
    group (a member's `old` is then left: its links break). If none did, nobody entered the grown
    group: each raises PeerError, and a member keeps `old` as it was (its links were never
    broken). Any other end of the agreement (QuorumError, ExcludedError: some may have carried
    on) breaks `old` too, since this rank cannot know that nobody left it. The error raised then
    blames `culprit` (the rank the failed formation blamed, numbered as in the grown group, whose
    ranks 0..k-1 are the members' own). why: how the formation failed, for the errors."""
    keeps = "this group stays as it was" if old is not None else "this process was not taken in"

    def decided(decision: membership.Decision) -> None:
        if all(decision.payloads[q].get("unformed") for q in decision.members):
            raise _NobodyFormed(f"{where}: {why}; it formed on none of its members that are left (ranks "
                                f"{decision.members} of it agreed so, coordinator rank {decision.coordinator}); "
                                f"{keeps}")
        need = size // 2 + 1
        if len(decision.members) < need:
            raise QuorumError(f"only its ranks {decision.members} are left to carry on in it (of {size}), and a "
                              f"group needs at least {need} (more than half): a minority must not carry on as the "
                              f"job")

    def carry_on(_: str) -> None:
        if break_old is not None:
            break_old(f"{where}: this group grew into a group of {size}, which lost a rank as it formed; its "
                      f"members carry on in the group grow() returned")

    listen, form, token = parts
    try:
        return rejoin(old, seat, size, listen, form, token, carry_on, timeout, epoch, decided)
    except _NobodyFormed as exc:
        raise blaming(PeerError(str(exc)), culprit) from None
    except DistributedError as exc:
        if break_old is not None:
            break_old(f"{where}: the grown group did not form on this rank and the agreement after it failed: {exc}")
        raise blaming(type(exc)(f"{where}: {why}; then the agreement of the grown group's members failed: {exc}"),
                      culprit) from None


def _loop(old: object | None, seat: membership.Seat, size: int, listen: Callable[[], list[tcp.Listener]],
          form: Callable[[membership.Seat, membership.Decision, list[int], list[tcp.Listener], float], Group],
          token: Callable[[membership.Seat, membership.Decision], int], break_links: Callable[[str], None],
          exclude: Sequence[int], min_size: int | None, timeout: float, floor: int,
          decided: Callable[[membership.Decision], None] | None,
          unformed: tcp.Listener | None) -> tuple[Group, list[int]]:
    """shrink() and rejoin(): unformed is rejoin()'s seat (this rank starts in a group that did
    not form), else None (it starts in `old`, formed)."""
    ranks = list(range(size))   # the rank in `old` of each rank of the group `seat` is in
    kept: list[tcp.Listener] = [unformed] if unformed is not None else []  # seats in groups that did not form
    left: list[membership.Tombstone] = []  # at the seats it moved on from, the kept ones included
    failures: list[str] = []
    label = "old ranks" if unformed is None else "ranks"
    for attempt in range(MAX_ATTEMPTS):
        again = attempt > 0 or unformed is not None
        listeners = listen()
        # After a failed formation the members give up at different moments: one that was
        # connecting to a stopped member waits out the handshake's answer timeout first.
        window = timeout if not again else timeout + ANSWER_TIMEOUT_S + 1.0
        payload: dict = {"addrs": [s.where() for s in listeners]}
        if attempt == 0 and unformed is not None:
            payload["unformed"] = True
        try:
            decision = membership.agree(seat, len(ranks), payload, exclude, min_size, window, floor)
        except BaseException as exc:
            for s in listeners:
                s.close()
            _close(kept, left)
            if again and isinstance(exc, DistributedError):
                raise type(exc)(f"{exc} (agreeing again in the group of epoch {floor - 1}, {label} {ranks}, which "
                                f"did not form on this rank)") from None
            raise
        if attempt == 0 and decided is not None:
            try:
                decided(decision)
            except BaseException:
                for s in listeners:
                    s.close()
                left.append(membership.Tombstone(seat, decision))  # a late join here learns this decision
                if old is None:
                    _close(kept, left)
                else:
                    keep_until_closed(old, kept, left)
                raise
        if attempt == 0:
            break_links(f"rank {seat.rank}: this group is being shrunk (epoch {decision.epoch})")
        # From now on a join (or a question) at this seat learns this decision: a member whose
        # coordinator died before telling it asks the members that were told.
        tombstone = membership.Tombstone(seat, decision)
        if attempt == 0 and unformed is None:
            _tombstones[old] = tombstone
        else:
            left.append(tombstone)
        members = [ranks[q] for q in decision.members]
        if len(members) == 1:
            for s in listeners:
                s.close()
            listeners = []
        else:
            listeners[0].hold()  # if the formation fails, its seat in this group's next agreement
        started = time.monotonic()
        try:
            new = form(seat, decision, members, listeners, timeout + 1.0)
        except DistributedError as exc:
            failures.append(f"epoch {decision.epoch}: {exc}")
            log.info("rank %d: shrink epoch %d: the new group of %s %s did not form after %.2f s (%s); "
                     "agreeing again as its rank %d", ranks[seat.rank], decision.epoch, label, members,
                     time.monotonic() - started, exc, decision.members.index(seat.rank))
            seat = _seat(seat, decision, listeners[0], token(seat, decision))
            kept.append(listeners[0])
            ranks, exclude, floor = members, [], decision.epoch + 1
            continue
        except BaseException:
            for s in listeners[:1]:
                s.release()
                s.close()
            _close(kept, left)
            raise
        if listeners:
            listeners[0].release()  # the group's own now
        _epochs[new] = decision.epoch
        if kept or left:
            # Late joins at the seats of the groups that did not form are answered while the new
            # group lives.
            keep_until_closed(new, kept, left)
        log.info("rank %d: shrink epoch %d: rank %d of the new group of %s %s", ranks[seat.rank],
                 decision.epoch, decision.members.index(seat.rank), label, members)
        return new, members
    _close(kept, left)
    raise PeerError(f"rank {ranks[seat.rank]}: shrink: the new group did not form in {MAX_ATTEMPTS} attempts: "
                    + "; ".join(failures))


def _seat(seat: membership.Seat, decision: membership.Decision, listener: tcp.Listener,
          token: int) -> membership.Seat:
    """This rank's seat in the agreement of the group `decision` names, which did not form here."""
    return unformed_seat(decision.members.index(seat.rank), [decision.payloads[q]["addrs"][0] for q in decision.members],
                         listener, decision.key(seat.auth), token, seat.purpose, decision.epoch,
                         [seat.name(q) for q in decision.members])


def unformed_seat(rank: int, addresses: list[str], listener: tcp.Listener, key: Auth, token: int, purpose: int,
                  epoch: int, names: list[int] | None = None) -> membership.Seat:
    """This rank's seat in the agreement of a group that did not form here (rank `rank` of the
    members listening first at `addresses`, under `key` and job context `token`; epoch: the
    group's): that group's first listener, admitting shrink connections (hello `purpose`) of its
    members alone from now on. names: the rank of each member as the caller knows it."""
    size = len(addresses)

    def admit(hello: tcp.Hello) -> str | None:
        if hello.purpose == purpose and 0 <= hello.sender < size and hello.sender != rank:
            return None
        return f"rank {rank} of a group that did not form only takes part in that group's shrink"

    listener.serve(key, token, rank, admit, f"rank {rank} (shrink epoch {epoch})")  # if not yet
    listener.readmit(admit)
    return membership.Seat(rank, addresses, listener, key, token, purpose, names)


def keep_until_closed(group: object, kept: list[tcp.Listener], left: list[membership.Tombstone]) -> None:
    """Close these seats and end these tombstones when `group` is closed (release(group)), or at
    the latest when it is garbage collected."""
    _kept.setdefault(group, []).append((kept, left))
    weakref.finalize(group, _close, kept, left)


def release(group: object) -> None:
    """Close the seats kept for `group` (keep_until_closed): its close() calls this."""
    try:
        held = _kept.pop(group, [])
    except TypeError:  # not weakly referenceable: nothing was kept for it
        return
    for kept, left in held:
        _close(kept, left)


def _close(kept: list[tcp.Listener], left: list[membership.Tombstone]) -> None:
    for tombstone in left:
        tombstone.close()
    for listener in kept:
        listener.release()
        listener.close()
