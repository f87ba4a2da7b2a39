"""shrink()'s backend-neutral loop, around the agreement (membership.py): every socket backend
that can shrink (the ring, JACCL on the TCP mesh) runs it and passes in only how it listens and
how it forms a group of the survivors.

Each attempt opens fresh listeners, agrees (their addresses travel in this rank's join), breaks
the old group's links (an operation still in flight there fails at once) and forms the new group
on the fresh listeners, under a key of the decision alone (Decision.key: an excluded rank, or
anyone who was not told the decision, cannot connect to it). A death during that formation (after
the decision) fails it on every member; they agree again with a higher epoch, a few times at most.
After a shrink the old group's listener answers later joins with the outcome (Tombstone), so a
rank that was only stopped learns that it was excluded.
"""
from __future__ import annotations

import logging
import time
import weakref
from typing import Callable, Sequence, TypeVar

from ...errors import DistributedError, PeerError
from . import membership, tcp
from .handshake import ANSWER_TIMEOUT_S

log = logging.getLogger("jacklring.shrink")

MAX_ATTEMPTS = 3      # agreements in one shrink() (each after a death during the last formation)

Group = TypeVar("Group")

_epochs: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_tombstones: "weakref.WeakKeyDictionary[object, membership.Tombstone]" = weakref.WeakKeyDictionary()


def epoch_of(group: object) -> int:
    """The epoch of the shrink or grow that formed this group (0 for a group formed at init or by split)."""
    return _epochs.get(group, 0)


def record_epoch(group: object, epoch: int) -> None:
    _epochs[group] = epoch


def shrink(old: object, seat: membership.Seat, size: int, listen: Callable[[], list[tcp.Listener]],
           form: Callable[[membership.Decision, list[tcp.Listener], float], Group],
           break_links: Callable[[str], None], exclude: Sequence[int], min_size: int | None,
           timeout: float) -> tuple[Group, membership.Decision]:
    """The survivors' group (see the module docstring), as this rank's new group, and the decision
    that made it. listen(): fresh listeners (their addresses are this rank's join payload, "addrs");
    form(decision, listeners, connect_timeout): the new group on them (no listener for a group of
    one), raising DistributedError when a member failed meanwhile; break_links(why): fail the old
    group's operations at once."""
    floor = epoch_of(old) + 1
    failures: list[str] = []
    for attempt in range(MAX_ATTEMPTS):
        listeners = listen()
        # After a failed formation the members give up at different moments: one that was
        # connecting to a stopped member waits out the handshake's answer timeout first.
        window = timeout if attempt == 0 else timeout + ANSWER_TIMEOUT_S + 1.0
        try:
            decision = membership.agree(seat, size, {"addrs": [s.where() for s in listeners]}, exclude, min_size,
                                        window, floor)
        except BaseException:
            for s in listeners:
                s.close()
            raise
        break_links(f"rank {seat.rank}: this group is being shrunk (epoch {decision.epoch})")
        members = decision.members
        if len(members) == 1:
            for s in listeners:
                s.close()
            listeners = []
        started = time.monotonic()
        try:
            new = form(decision, listeners, timeout + 1.0)
        except DistributedError as exc:
            failures.append(f"epoch {decision.epoch}: {exc}")
            log.info("rank %d: shrink epoch %d: the new group of old ranks %s did not form after %.2f s (%s); "
                     "agreeing again", seat.rank, decision.epoch, members, time.monotonic() - started, exc)
            floor = decision.epoch + 1
            continue
        _epochs[new] = decision.epoch
        _tombstones[old] = membership.Tombstone(seat, decision)
        log.info("rank %d: shrink epoch %d: rank %d of the new group of old ranks %s", seat.rank, decision.epoch,
                 members.index(seat.rank), members)
        return new, decision
    raise PeerError(f"rank {seat.rank}: shrink: the new group did not form in {MAX_ATTEMPTS} attempts: "
                    + "; ".join(failures))
