"""Where a ring group came from, and so where grow() finds a newcomer: the group's origin (the
hostfile it was first formed from, or the store it was formed through) and which of the first
group's ranks (slots) each of its ranks holds. A newcomer takes a vacant slot (a dead rank's)
and proves the job key of the origin. Shrink and grow pass the lineage on to the groups they
form, with the knock records (a store origin's newcomers) that a grow already used.

The store's side of an origin lives in adapter/rendezvous/store_grow.py (a layer above this
one); this module names only what grow() asks of any origin (Origin).
"""
from __future__ import annotations

import contextlib
import json
import os
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Protocol

from ...errors import PeerError
from ..transport import auth, holder, tcp

if TYPE_CHECKING:
    from ..base import Backend


@dataclass(frozen=True)
class Found:
    """A newcomer's address as an origin gives it; `record` names the store's knock record it
    came from (None for a hostfile address), so a grow that took it in marks it used."""
    address: str
    record: str | None = None


class Origin(Protocol):
    """What grow() asks of the place newcomers are found."""

    def size(self) -> int:
        """How many slots the first group had."""

    def auth(self) -> auth.Auth:
        """The job key a newcomer proves (computed by the newcomer alike)."""

    def token(self) -> int:
        """The job context id of grow's connections."""

    def refusal(self, held: list[int]) -> str | None:
        """Why no newcomer can be found for a group holding these slots, or None."""

    def where(self, slot: int) -> str:
        """The slot's place, for errors."""

    def find(self, slot: int, used: frozenset[str]) -> Found | str:
        """The address of the newcomer waiting at `slot`, or why there is none; IntegrityError
        when what the origin holds for the slot was tampered with."""

    def hosts(self, slot: int) -> list[str]:
        """Where the newcomer at `slot` opens its listeners for the grown ring."""

    def waiting(self, slot: int) -> contextlib.AbstractContextManager[tcp.Listener]:
        """As the newcomer at `slot`: a listener the recruiter finds through this origin while
        the body runs."""


@dataclass(frozen=True)
class HostfileOrigin:
    """MLX_HOSTFILE's addresses by slot: a newcomer listens at its slot's first address."""
    addresses: list[list[str]]

    def size(self) -> int:
        return len(self.addresses)

    def auth(self) -> auth.Auth:
        return origin_auth(self.addresses)

    def token(self) -> int:
        return origin_token(self.addresses)

    def refusal(self, held: list[int]) -> str | None:
        return None

    def where(self, slot: int) -> str:
        return self.addresses[slot][0]

    def find(self, slot: int, used: frozenset[str]) -> Found | str:
        return Found(self.addresses[slot][0])

    def hosts(self, slot: int) -> list[str]:
        return [tcp.parse_address(a)[0] for a in self.addresses[slot]]

    @contextlib.contextmanager
    def waiting(self, slot: int) -> Iterator[tcp.Listener]:
        host, port = tcp.parse_address(self.addresses[slot][0])
        try:
            listener = tcp.Listener(host, port)
        except PeerError as exc:
            held = holder.holder(host, port)
            question = ("another user's process squats it (it is not the rank this one replaces)"
                        if held is not None and held.uid != os.getuid() else "is the rank it replaces still running?")
            raise PeerError(f"slot {slot}: this replacement cannot listen at its slot's address "
                            f"{self.addresses[slot][0]} ({exc}); {question}") from None
        try:
            yield listener
        finally:
            listener.close()


@dataclass(frozen=True)
class Lineage:
    origin: Origin            # where newcomers are found (HostfileOrigin, or the store's)
    slots: list[int]          # the slot each rank of this group holds, by rank
    used: frozenset[str] = field(default_factory=frozenset)  # knock records a grow took in already

    def vacant(self) -> list[int]:
        """The slots no rank of this group holds, ascending: where a newcomer may wait."""
        held = set(self.slots)
        return [s for s in range(self.origin.size()) if s not in held]

    def keep(self, ranks: list[int]) -> "Lineage":
        """The lineage of the group of these ranks (a shrink's members, in their order)."""
        return Lineage(self.origin, [self.slots[r] for r in ranks], self.used)


_lineages: "weakref.WeakKeyDictionary[Backend, Lineage]" = weakref.WeakKeyDictionary()
_refusals: "weakref.WeakKeyDictionary[Backend, str]" = weakref.WeakKeyDictionary()


def record(backend: "Backend", lineage: Lineage) -> None:
    _lineages[backend] = lineage


def of(backend: "Backend") -> Lineage | None:
    """The lineage of a ring that can grow; None for one no newcomer can find (refusal() says why)."""
    return _lineages.get(backend)


def refuse(backend: "Backend", why: str) -> None:
    """This ring can never grow, for this reason (a torch process group's, a split()'s)."""
    _refusals[backend] = why


def refusal(backend: "Backend") -> str:
    """Why a ring without a lineage cannot grow."""
    return _refusals.get(backend, "it was formed by split() (a sub-group has no slots of the job's first group "
                                  "for a newcomer to take)")


def origin_auth(origin: list[list[str]]) -> auth.Auth:
    """The job key as a process started from this hostfile computes it: the same as the first
    ring's when the job has a secret (stretched once, salted by the addresses)."""
    text = json.dumps(origin).encode()
    return auth.job_auth(text, "growing the ring", salt=text)


def origin_token(origin: list[list[str]]) -> int:
    """The job context id of grow's connections: the hostfile alone (not its incarnation, which
    a replacement process does not know)."""
    return auth.context_id(json.dumps([origin, "grow"]).encode())
