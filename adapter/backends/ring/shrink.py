"""shrink() for the ring: agree on the survivors and form a fresh ring of them on new listeners
(the backend-neutral loop is elastic/shrinking.py, the agreement elastic/membership.py).
Shared memory attaches as at init when the survivors share a host; the lineage (grow's map of
hostfile slots) follows the survivors.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..elastic import membership, shrinking
from ..transport import tcp
from . import lineage

if TYPE_CHECKING:
    from .backend import RingBackend

epoch_of, record_epoch = shrinking.epoch_of, shrinking.record_epoch  # grow numbers its groups on


def shrink_ring(old: "RingBackend", seat: membership.Seat, addresses: list[list[str]], exclude: Sequence[int],
                min_size: int | None, timeout: float) -> "RingBackend":
    """The ring of the survivors, as this rank's new backend (see the module docstring)."""
    listen, form, token = ring_parts(type(old), addresses[seat.rank], min(len(a) for a in addresses), old.timeout)
    new, members = shrinking.shrink(old, seat, len(addresses), listen, form, token, old.break_links, exclude,
                                    min_size, timeout)
    origin = lineage.of(old)
    if origin is not None:
        lineage.record(new, origin.keep(members))  # so the survivors can grow again
    else:
        lineage.refuse(new, lineage.refusal(old))  # grow() names the first group's reason
    return new


def ring_parts(ring: "type[RingBackend]", mine: list[str], k: int, op_timeout: float) -> tuple:
    """shrinking's listen, form and token for a ring: fresh listeners on the hosts of this rank's
    first k addresses `mine`, and the ring (of class `ring`, passed in so that this module need not
    import the backend that calls it) a decision names on them (operations under op_timeout)."""
    hosts = [tcp.parse_address(a)[0] for a in mine[:k]]

    def listen() -> list[tcp.Listener]:
        return [tcp.Listener(host, 0) for host in hosts]

    def form(seat: membership.Seat, decision: membership.Decision, members: list[int], listeners: list[tcp.Listener],
             connect_timeout: float) -> "RingBackend":
        return ring(decision.members.index(seat.rank), addresses_of(decision), listeners, op_timeout,
                           connect_timeout=connect_timeout, incarnation=decision.epoch, job=decision.key(seat.auth),
                           decided=True)

    def token(seat: membership.Seat, decision: membership.Decision) -> int:
        return ring.context_token(addresses_of(decision), decision.epoch)

    return listen, form, token


def addresses_of(decision: membership.Decision) -> list[list[str]]:
    """The new ring's addresses, by its rank: each member's fresh listeners, from its join."""
    return [decision.payloads[q]["addrs"] for q in decision.members]
