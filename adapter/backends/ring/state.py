"""The state every part of a ring group shares: who it is, its addresses and listeners, its
keys, its ring links, the collective running now, and its shared memory.

One RingState per group; the backend creates it and hands it to the parts (forming.py,
point_to_point.py, splitting.py, plumbing.py, shared.py, origin.py), which read and
write its fields instead of each other's attributes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..base import GroupFailure
from ..transport import auth, tcp
from ..transport.stream_engine import Engine, Stream

if TYPE_CHECKING:
    from ..local.shm import SharedGroup
    from ..local.staged import Staging
    from .standby import Standby


@dataclass(eq=False)
class RingState:
    rank: int
    size: int
    addresses: list[list[str]]       # per rank, the "ip:port" addresses it listens on
    listeners: list[tcp.Listener]    # this rank's, one per address (none in a group of one)
    token: bytes                     # the job context's id, in every hello
    auth: auth.Auth                  # the job secret's keys
    timeout: float                   # the per-operation deadline, in seconds
    connect_timeout: float           # how long forming may take
    verify: str | None               # JACKLRING_VERIFY: the trailers of every link
    failure: GroupFailure            # the group's (Backend.failure)
    right: list[Stream] = field(default_factory=list)  # ring links to rank + 1, one per address
    left: list[Stream] = field(default_factory=list)   # ring links from rank - 1
    engine: Engine | None = None     # moves the ring links' bytes
    deadline: float = 0.0            # the running collective's (time.monotonic)
    what: object = None              # the running collective, described on demand (plumbing.Described)
    stage: int = 0                   # on a leaders' ring: the tag of the group's collective (local/staged.py)
    hier: "Staging | None" = None   # when it spans hosts, some with several ranks
    # While a split's (or init's) closing barrier runs: a failure passes the verdict on over the
    # ring links (forming.abandon), and collectives stay on the ring.
    abandon_on_failure: bool = False
    standby: "Standby | None" = None  # point-to-point partners' standby notice connections (standby.py)
    # Behind the properties seq and shm: the count while no segment holds it, the segment.
    _count: int = 0
    _segment: "SharedGroup | None" = None

    @property
    def seq(self) -> int:
        """Collectives run so far (in every header). While the whole group shares a segment the
        engine keeps it (SharedGroup.sequence: one count for Python, the engine's fast path and
        C++ callers), so a collective has the same number whichever path runs it."""
        segment = self._segment
        return self._count if segment is None else segment.sequence

    @seq.setter
    def seq(self, value: int) -> None:
        segment = self._segment
        if segment is None:
            self._count = value
        else:
            segment.sequence = value

    @property
    def shm(self) -> "SharedGroup | None":
        """The segment, when the whole group is on this host."""
        return self._segment

    @shm.setter
    def shm(self, group: "SharedGroup | None") -> None:
        # The count moves with it: into the segment at attach, back out before it closes.
        old = self._segment
        if old is not None:
            self._count = old.sequence
        if group is not None:
            group.sequence = self._count
        self._segment = group

    def who(self, rank: int, index: int = 0) -> str:
        """A rank and its address `index`, for messages."""
        return f"rank {rank} ({self.addresses[rank][index]})"

    def links(self) -> list[Stream]:
        """Every ring link, right then left."""
        return self.right + self.left
