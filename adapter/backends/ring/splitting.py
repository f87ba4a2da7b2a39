"""split() of a ring group: each rank listens afresh, the records (color, key, addresses) are
gathered over this ring, and the sub-rings form while every rank watches its parent links, so a
death or a rank that gives up anywhere fails every rank's split at once, naming it."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

from ...errors import ConfigError, DistributedError, PeerError, blaming, failure_of
from ..base import split_members
from ..elements import byte_view, dtype_code
from ..transport import tcp
from .addresses import links_per_neighbour
from .formation import FormationAbandoned, Watch
from .forming import Wording, abandon
from .header import HEADER, HEADER_MAGIC, OP_SPLIT, SEQ_MASK, find_abort
from .plumbing import Plumbing
from .state import RingState

if TYPE_CHECKING:
    from .backend import RingBackend


class SplitAbandoned(FormationAbandoned):
    """A sub-group stopped forming because `culprit` (a parent rank, or -1) died or gave up."""


def split(ring: "RingBackend", state: RingState, words: Wording, plumbing: Plumbing,
          color: int, key: int) -> "RingBackend":
    """Form sub-rings of `ring` (whose state, wording and plumbing these are): fresh listeners,
    addresses exchanged over this ring."""
    state.failure.check()
    make = type(ring)
    rank, size = state.rank, state.size
    if size == 1:
        return make(0, state.addresses, [], state.timeout, state.connect_timeout, job=state.auth)
    k = links_per_neighbour(state.addresses)
    # Sub-ring connection c listens on the host of this rank's address c, so a sub-ring
    # uses the same interfaces as its parent.
    hosts = [tcp.parse_address(a)[0] for a in state.addresses[rank][:k]]
    listeners: list[tcp.Listener] = []
    try:
        for host in hosts:
            listeners.append(tcp.Listener(host, 0))
    except DistributedError as exc:
        for s in listeners:
            s.close()
        abandon(state, words, rank)  # the others must not wait for this rank's record
        raise type(exc)(f"rank {rank}: split(color={color}): {exc}") from None
    try:
        entries = _gather_records(state, plumbing, color, key, listeners)
    except BaseException:
        for s in listeners:
            s.close()
        raise
    colors, keys = [e["color"] for e in entries], [e["key"] for e in entries]
    members = [entries[p] for p in split_members(colors, keys, color)]
    new_rank = [e["rank"] for e in members].index(rank)
    if len(members) == 1:
        for s in listeners:
            s.close()
        listeners = []
    sub_ranks = {p: split_members(colors, keys, colors[p]).index(p) for p in range(size)}
    words.describe_member = lambda p: (f"parent rank {p} (rank {sub_ranks[p]} of the sub-group of color "
                                       f"{entries[p]['color']})")
    words.task, words.forming, words.member_word = "the split", "the sub-groups", "parent rank"
    words.abandoned = SplitAbandoned
    what = f"rank {rank}: split(color={color}) (rank {new_rank} of its sub-group)"
    # While the sub-rings connect, each rank watches its parent links (and the sub-ring's
    # connections made so far) for a death or an abort.
    watch = Watch(find_abort, words.abort_header, words.abort_text, words.describe_member, words.forming,
                  SplitAbandoned)
    for link in state.right + state.left:
        watch.add(link.sock, link.peer)
    try:
        # A sub-ring keeps the job secret; without one its key follows its own addresses.
        sub = make(new_rank, [e["addrs"] for e in members], listeners, state.timeout,
                   state.connect_timeout, job=state.auth if state.auth.secret else None,
                   watch=watch, parent_ranks=[e["rank"] for e in members])
    except FormationAbandoned as exc:
        abandon(state, words, exc.culprit, exc.missing)
        raise blaming(PeerError(f"{what}: {exc}"), exc.culprit) from None
    except DistributedError as exc:
        try:
            watch.check()  # the sub-group's failure is often the echo of a death in the parent
        except FormationAbandoned as cause:
            abandon(state, words, cause.culprit, cause.missing)
            raise blaming(PeerError(f"{what}: {cause} ({exc})"), cause.culprit) from None
        culprit = getattr(exc, "missing_rank", None)  # by parent rank (the watch's numbering)
        abandon(state, words, -1 if culprit is None else culprit, culprit is not None)
        named = f" ({words.describe_member(culprit)} did not join its sub-group)" if culprit is not None else ""
        raise blaming(type(exc)(f"{what}: {exc}{named}"), culprit) from None
    sub.split_formed()
    state.abandon_on_failure = True
    try:
        ring.barrier()  # every rank formed its sub-group: the formation ends together everywhere
    except DistributedError as exc:
        sub.close()
        neighbours = "; ".join(words.describe_member(p) for p in sorted({link.peer for link in state.right}
                                                                        | {link.peer for link in state.left}))
        blamed = failure_of(exc).suspect(None)
        raise blaming(PeerError(f"{what}: the sub-groups did not form on every rank: {exc} "
                                f"(this rank's parent neighbours: {neighbours})"), blamed) from None
    finally:
        state.abandon_on_failure = False
    return sub


def _gather_records(state: RingState, plumbing: Plumbing, color: int, key: int,
                    listeners: list[tcp.Listener]) -> list[dict]:
    k = len(listeners)
    mine = json.dumps({"color": color, "key": key, "rank": state.rank,
                       "addrs": [tcp.format_address(s.getsockname()[:2]) for s in listeners]}).encode()
    # Same size on every rank (k is): room for k of the longest "[ipv6]:port" plus the ints.
    record = np.zeros(128 + 56 * k, np.uint8)
    if len(mine) > record.size:
        raise ConfigError(f"rank {state.rank}: split record too long ({len(mine)} bytes)")
    record[:len(mine)] = np.frombuffer(mine, np.uint8)
    table = np.empty(record.size * state.size, np.uint8)
    header = HEADER.pack(HEADER_MAGIC, OP_SPLIT, dtype_code(np.uint8), state.seq & SEQ_MASK, record.nbytes, 0)

    def run() -> None:
        for q, part in enumerate(plumbing.small_gather(header, byte_view(record))):
            table[q * record.size:(q + 1) * record.size] = np.frombuffer(part, np.uint8)
    plumbing.collective(header, run)
    size = record.size
    return [json.loads(bytes(table[q * size:(q + 1) * size]).rstrip(b"\0")) for q in range(state.size)]
