"""Where a ring group came from: the hostfile it was first formed from, and which of that file's
address slots each of its ranks holds. grow() needs both: a replacement listens at a vacant
slot's address (a dead rank's), which is where the members look for it, and it proves the job
key of that hostfile. Shrink and grow pass the lineage on to the groups they form.
"""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..transport import auth

if TYPE_CHECKING:
    from ..base import Backend


@dataclass(frozen=True)
class Lineage:
    origin: list[list[str]]   # the hostfile's addresses, by slot (the first ring's rank)
    slots: list[int]          # the slot each rank of this group holds, by rank

    def vacant(self) -> list[int]:
        """The slots no rank of this group holds, ascending: where a newcomer may listen."""
        held = set(self.slots)
        return [s for s in range(len(self.origin)) if s not in held]

    def keep(self, ranks: list[int]) -> "Lineage":
        """The lineage of the group of these ranks (a shrink's members, in their order)."""
        return Lineage(self.origin, [self.slots[r] for r in ranks])


_lineages: "weakref.WeakKeyDictionary[Backend, Lineage]" = weakref.WeakKeyDictionary()


def record(backend: "Backend", lineage: Lineage) -> None:
    _lineages[backend] = lineage


def of(backend: "Backend") -> Lineage | None:
    """The lineage of a ring formed from a hostfile (or shrunk or grown from one); None for a
    ring formed through a store or by split(), which no newcomer can find."""
    return _lineages.get(backend)


def origin_auth(origin: list[list[str]]) -> auth.Auth:
    """The job key as a process started from this hostfile computes it: the same as the first
    ring's when the job has a secret (stretched once, salted by the addresses)."""
    text = json.dumps(origin).encode()
    return auth.job_auth(text, "growing the ring", salt=text)


def origin_token(origin: list[list[str]]) -> int:
    """The job context id of grow's connections: the hostfile alone (not its incarnation, which
    a replacement process does not know)."""
    return auth.context_id(json.dumps([origin, "grow"]).encode())
