"""shrink() for the ring: agree on the survivors (transport/membership.py), then form a fresh ring
of them on new listeners, under a key of the decision alone (so an excluded rank, or anyone who
was not told the decision, cannot connect to it). Shared memory attaches as at init when the
survivors share a host.

A death during the new ring's formation (after the decision) fails the formation on every
member; they agree again with a higher epoch, a few times at most.
"""
from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING, Sequence

from ...errors import DistributedError, PeerError
from ..transport import membership, tcp
from ..transport.handshake import ANSWER_TIMEOUT_S
from . import lineage

if TYPE_CHECKING:
    from .backend import RingBackend

log = logging.getLogger("jacklring.shrink")

PURPOSE_SHRINK = 5    # 1-4: the ring's own connections, the formation's aborts, origin's notices
MAX_ATTEMPTS = 3      # agreements in one shrink() (each after a death during the last formation)

_epochs: "weakref.WeakKeyDictionary[RingBackend, int]" = weakref.WeakKeyDictionary()
_tombstones: "weakref.WeakKeyDictionary[RingBackend, membership.Tombstone]" = weakref.WeakKeyDictionary()


def admits(sender: int, rank: int, size: int) -> str | None:
    """Who may open a shrink connection to this rank's first listener: any other old member."""
    return None if 0 <= sender < size and sender != rank else f"no rank {sender} shrinks here"


def epoch_of(backend: "RingBackend") -> int:
    """The epoch of the shrink or grow that formed this group (0 for a group formed at init or by split)."""
    return _epochs.get(backend, 0)


def record_epoch(backend: "RingBackend", epoch: int) -> None:
    _epochs[backend] = epoch


def shrink_ring(old: "RingBackend", seat: membership.Seat, addresses: list[list[str]], exclude: Sequence[int],
                min_size: int | None, timeout: float) -> "RingBackend":
    """The ring of the survivors, as this rank's new backend (see the module docstring)."""
    from .backend import RingBackend  # the class that formed `old`; a lazy import keeps the modules apart

    k = min(len(a) for a in addresses)
    hosts = [tcp.parse_address(a)[0] for a in addresses[seat.rank][:k]]
    floor = epoch_of(old) + 1
    failures: list[str] = []
    for attempt in range(MAX_ATTEMPTS):
        listeners = [tcp.Listener(host, 0) for host in hosts]
        # After a failed formation the members give up at different moments: one that was
        # connecting to a stopped member waits out the handshake's answer timeout first.
        window = timeout if attempt == 0 else timeout + ANSWER_TIMEOUT_S + 1.0
        try:
            decision = membership.agree(seat, len(addresses), {"addrs": [s.where() for s in listeners]},
                                        exclude, min_size, window, floor)
        except BaseException:
            for s in listeners:
                s.close()
            raise
        # The old ring's links go now: a rank still in a collective of the old group fails at once.
        old.break_links(f"rank {seat.rank}: this group is being shrunk (epoch {decision.epoch})")
        members = decision.members
        new_rank = members.index(seat.rank)
        if len(members) == 1:
            for s in listeners:
                s.close()
            listeners = []
        started = time.monotonic()
        try:
            new = RingBackend(new_rank, [decision.payloads[q]["addrs"] for q in members], listeners, old.timeout,
                              connect_timeout=timeout + 1.0, incarnation=decision.epoch,
                              job=decision.key(seat.auth))
        except DistributedError as exc:
            failures.append(f"epoch {decision.epoch}: {exc}")
            log.info("rank %d: shrink epoch %d: the new group of old ranks %s did not form after %.2f s (%s); "
                     "agreeing again", seat.rank, decision.epoch, members, time.monotonic() - started, exc)
            floor = decision.epoch + 1
            continue
        _epochs[new] = decision.epoch
        origin = lineage.of(old)
        if origin is not None:
            lineage.record(new, origin.keep(members))  # so the survivors can grow again
        _tombstones[old] = membership.Tombstone(seat, decision)
        log.info("rank %d: shrink epoch %d: rank %d of the new group of old ranks %s", seat.rank, decision.epoch,
                 new_rank, members)
        return new
    raise PeerError(f"rank {seat.rank}: shrink: the new group did not form in {MAX_ATTEMPTS} attempts: "
                    + "; ".join(failures))
