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
    from ..local.shell import CollectiveShell
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
    stage: int = 0                   # on a leaders' ring: the tag of the group's collective (local/staged.py)
    hier: "Staging | None" = None   # when it spans hosts, some with several ranks
    # While a split's (or init's) closing barrier runs: a failure passes the verdict on over the
    # ring links (forming.abandon), and collectives stay on the ring.
    abandon_on_failure: bool = False
    standby: "Standby | None" = None  # point-to-point partners' standby notice connections (standby.py)
    # One collective at a time, numbered, with header, deadline and failure (set by Plumbing).
    shell: "CollectiveShell | None" = None

    @property
    def seq(self) -> int:
        """Collectives run so far (in every header): the shell's count, which the engine keeps
        while the whole group shares a segment (one count for Python, the engine's fast path and
        C++ callers), so a collective has the same number whichever path runs it."""
        return self.shell.seq  # type: ignore[union-attr]

    @seq.setter
    def seq(self, value: int) -> None:
        self.shell.seq = value  # type: ignore[union-attr]

    @property
    def what(self) -> object:
        """The running (or last) collective, described on demand, for messages."""
        return self.shell.what  # type: ignore[union-attr]

    @property
    def shm(self) -> "SharedGroup | None":
        """The segment, when the whole group is on this host (the shell holds it: it keeps the count)."""
        return self.shell.segment  # type: ignore[union-attr]

    @shm.setter
    def shm(self, group: "SharedGroup | None") -> None:
        self.shell.attach(group)  # type: ignore[union-attr]

    def who(self, rank: int, index: int = 0) -> str:
        """A rank and its address `index`, for messages."""
        return f"rank {rank} ({self.addresses[rank][index]})"

    def links(self) -> list[Stream]:
        """Every ring link, right then left."""
        return self.right + self.left
