"""The transport interface every schedule of this package is written against.

A schedule is a list of steps; in each step a rank sends one message to some peers and receives
one message from some peers (often the same one: a pair exchange). Both sides know every
message's length in advance, so the interface moves bytes into caller-owned views and never
allocates. The implementation owns the deadline (one per collective), the request header each
message carries (so a rank that runs another collective fails with a MismatchError naming
both), and failure attribution (a dead peer is a PeerError naming it).
"""
from __future__ import annotations

from typing import Mapping, Protocol


class PeerExchange(Protocol):
    """Messages between any two ranks of a group, one step of a schedule at a time."""

    rank: int
    size: int

    def sendrecv(self, step: int, sends: Mapping[int, memoryview], recvs: Mapping[int, memoryview]) -> None:
        """Send sends[peer] to each peer and receive exactly len(recvs[peer]) bytes from each
        peer into recvs[peer]; return when all are done. `step` numbers the schedule's steps
        (0, 1, ...) so a transport may tag its messages with it. Raises PeerError (a peer died or
        left), CollectiveTimeout (the deadline passed; it names the peers still owed) or
        MismatchError (a peer runs another collective), each naming this rank and the peer.

        Two ranks that send each other a message in the same step must not deadlock, whatever
        the sizes (the implementation reads while it writes). A step whose send and receive
        peers differ (barrier, broadcast) carries small messages only."""
