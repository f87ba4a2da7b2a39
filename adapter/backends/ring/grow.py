"""grow() for the ring: the members take in newcomers (replacements for dead ranks) and form a
new ring with them; the newcomer's side is join_ring().

A newcomer is a process started with JACKLRING_JOIN=1 at a vacant slot (a rank of the first ring
that no member holds now, e.g. a dead rank's): MLX_RANK of the job's hostfile, or RANK of a
group formed through a torch store. It waits where the group's origin (lineage.py) lets the
members find it: at that slot's first hostfile address, or at a fresh listener whose address it
publishes in the store as a MACed knock record (adapter/rendezvous/store_grow.py). The members
call grow() together. They trade the addresses of fresh listeners over their own ring (an
all_gather), and rank 0 recruits: it connects to each vacant slot's address (as the origin gives
it) through the authenticated handshake under the job key (elastic/enrolment.py) until it
has `count` newcomers or `timeout` passes, then broadcasts the
decision over the members' ring and sends it to each newcomer. The decision names the new
ranks: the members keep theirs (0..k-1) and the newcomers follow in ascending slot order (k,
k+1, ...). Everybody then forms a ring on the fresh listeners under a key derived from the job
key, a fresh nonce and the epoch (the same derivation as shrink's), so a process that was not
told the decision cannot connect to it. If too few newcomers answered, the newcomers that did
are told the attempt is off (they wait for the next one) and every member raises
CollectiveTimeout; the members' group stays as it was. A rank on which the grown ring does not
form (a rank died after the decision) agrees in it with the others (after_failure): they carry on
in the outcome if any of them formed it, else the members keep their group.
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from ... import logs
from ...errors import CollectiveTimeout, DistributedError, IntegrityError, culprit_of
from ..elastic import enrolment, shrinking
from ..transport import tcp
from ..transport.auth import Auth
from . import lineage, shrink
from .header import PURPOSE_SHRINK
from .lineage import Lineage, Origin

if TYPE_CHECKING:
    from .backend import RingBackend

log = logging.getLogger("jacklring.grow")

PURPOSE_GROW = 6        # 1-4: the ring's own connections, aborts, origin's notices; 5: shrink
RECRUIT_EVERY_S = 0.05  # how often the recruiter looks again at a vacant slot nobody answered at


def admit_invitation(hello: tcp.Hello) -> str | None:
    return None if hello.purpose == PURPOSE_GROW else "this process only waits to be invited into a group (grow)"


def grow_ring(old: "RingBackend", count: int | None, timeout: float) -> "RingBackend":
    """The ring of the members and `count` newcomers (default: one per vacant slot), as this
    member's new backend (see the module docstring)."""
    ring = type(old)  # the grown ring is of old's class: this module never imports the backend
    state = old.state
    me, size = state.rank, state.size
    lin = lineage.of(old)
    if lin is None:
        raise DistributedError(
            f"rank {me}: grow: this group cannot take in newcomers: {lineage.refusal(old)}. Only a ring group "
            f"formed from MLX_HOSTFILE or through torchrun's / Slurm's store, or shrunk or grown from one, can")
    refused = lin.origin.refusal(lin.slots)
    if refused is not None:
        raise DistributedError(f"rank {me}: grow: {refused}")
    vacant = lin.vacant()
    want = len(vacant) if count is None else int(count)
    if not 1 <= want <= len(vacant):
        raise ValueError(f"rank {me}: grow: count={count} but the job's first group has {len(vacant)} vacant "
                         f"slot(s) {vacant} (slots held: {lin.slots})")
    if size > 1 and not state.listeners:
        raise DistributedError(f"rank {me}: this ring group was closed; it cannot grow")
    hosts = [tcp.parse_address(a)[0] for a in state.addresses[me]]
    listeners = [tcp.Listener(host, 0) for host in hosts]
    epoch = shrink.epoch_of(old) + 1
    saved = state.timeout
    try:
        # Rank 0 recruits for up to `timeout`; the others wait in the broadcast meanwhile.
        old.set_timeout(max(saved, timeout + 10.0))
        members = enrolment.gather_addresses(old, [s.where() for s in listeners])
        if me == 0:
            decision = _recruit(old, lin, vacant, want, members, epoch, timeout)
        else:
            decision = {}
        decision = enrolment.broadcast_decision(old, decision)
    except BaseException:
        for s in listeners:
            s.close()
        raise
    finally:
        old.set_timeout(saved)
    if not decision.get("ok"):
        for s in listeners:
            s.close()
        kind = IntegrityError if decision.get("tampered") else CollectiveTimeout
        raise kind(f"rank {me}: grow: {decision.get('why')} (decided by rank 0); this group stays as it was")
    slots, addresses = [int(s) for s in decision["slots"]], decision["addresses"]
    grown = Lineage(lin.origin, slots, lin.used | frozenset(decision.get("records", [])))
    key = enrolment.group_key(lin.origin.auth(), bytes.fromhex(decision["nonce"]), epoch)
    started = time.monotonic()
    listeners[0].hold()  # if the formation fails here, this rank's seat in the agreement after it
    try:
        new = ring(me, addresses, listeners, saved, connect_timeout=timeout + 5.0, incarnation=epoch,
                          job=key, decided=True)
    except DistributedError as exc:
        why = f"the group of {len(slots)} did not form after {time.monotonic() - started:.2f} s ({exc})"
        return after_failure(ring, f"rank {me}: grow epoch {epoch}", me, addresses, listeners[0], key, epoch, saved,
                             timeout, grown, old, why, culprit_of(exc))
    except BaseException:
        listeners[0].release()
        listeners[0].close()
        raise
    listeners[0].release()
    old.break_links(f"rank {me}: this group grew into a group of {len(slots)} (epoch {epoch})")
    lineage.record(new, grown)
    shrink.record_epoch(new, epoch)
    log.info("rank %d: grow epoch %d: %d newcomer(s) from slots %s, %d ranks", me, epoch, len(slots) - size,
             slots[size:], len(slots))
    return new


def after_failure(ring: "type[RingBackend]", where: str, rank: int, addresses: list[list[str]],
                  listener: tcp.Listener, key: Auth, epoch: int, op_timeout: float | None, timeout: float,
                  grown: Lineage, old: "RingBackend | None",
                  why: str, culprit: int | None = None) -> "RingBackend":
    """The grown ring (rank `rank` of `addresses`, epoch `epoch`, key `key`) did not form on this
    rank, a member or a newcomer: the agreement after it (shrinking.after_grow_failure, at its
    first listener `listener`, held), and the ring (of class `ring`) of its outcome, which this
    rank returns."""
    token = ring.context_token(addresses, epoch)
    seat = shrinking.unformed_seat(rank, [a[0] for a in addresses], listener, key, token, PURPOSE_SHRINK, epoch)
    parts = shrink.ring_parts(ring, addresses[rank], min(len(a) for a in addresses), op_timeout)
    new, members = shrinking.after_grow_failure(where, seat, len(addresses), parts, old,
                                                None if old is None else old.break_links, timeout, epoch, why,
                                                culprit)
    lineage.record(new, grown.keep(members))
    log.info("%s: the group of %d did not form here; its ranks %s carry on as a group of %d", where, len(addresses),
             members, new.size())
    return new


def _recruit(old: "RingBackend", lin: Lineage, vacant: list[int], want: int, members: list[list[str]],
             epoch: int, timeout: float) -> dict:
    """As rank 0: find `want` newcomers at the vacant slots within timeout; the decision (sent to
    each newcomer too), or {"ok": False, "why": ..., "tampered": ...}. The origin gives each
    slot's address (its hostfile address, or the store's knock record of a newcomer there);
    a slot whose knock record failed its check counts as tampered with until a valid one
    replaces it."""
    origin = lin.origin
    auth, token = origin.auth(), origin.token()
    answer_timeout = min(1.0, max(0.05, timeout / 4))
    deadline = time.monotonic() + timeout
    found: dict[int, tuple] = {}
    records: dict[int, str] = {}
    why_not: dict[int, str] = {}
    tampered: set[int] = set()
    while True:
        for s in vacant:
            if s in found or len(found) >= want:
                continue
            try:
                where = origin.find(s, lin.used)
            except IntegrityError as exc:
                why_not[s] = str(exc)
                tampered.add(s)
                continue
            tampered.discard(s)
            if isinstance(where, str):
                why_not[s] = where
                continue
            got = enrolment.recruit(where.address, s, auth, token, PURPOSE_GROW, 0, epoch, answer_timeout,
                                    timeout)
            if isinstance(got, str):
                why_not[s] = got
            else:
                found[s] = got
                if where.record is not None:
                    records[s] = where.record
                why_not.pop(s, None)
        if len(found) >= want or time.monotonic() >= deadline:
            break
        time.sleep(RECRUIT_EVERY_S)
    tell_by = time.monotonic() + answer_timeout
    if len(found) < want:
        reasons = "; ".join(f"slot {s} ({origin.where(s)}): {why_not.get(s, 'not tried')}" for s in vacant
                            if s not in found)
        why = (f"only {len(found)} of {want} newcomer(s) joined within {timeout:g} s (vacant slots {vacant}: "
               f"{reasons})")
        for channel, _ in found.values():
            enrolment.tell(channel, {"kind": "cancel", "why": why}, tell_by)
        return {"ok": False, "why": why, "tampered": bool(tampered - set(found))}
    newcomers = sorted(found)
    decision = {"ok": True, "kind": "decision", "epoch": epoch, "nonce": os.urandom(16).hex(), "timeout": timeout,
                "slots": lin.slots + newcomers, "records": sorted(records.values()),
                "addresses": members + [found[s][1]["addrs"] for s in newcomers]}
    for s in newcomers:
        failed = enrolment.tell(found[s][0], decision, tell_by)
        if failed is not None:
            log.info("rank 0: grow epoch %d: the newcomer at slot %d was not told: %s", epoch, s, failed)
    return decision


def join_ring(ring: "type[RingBackend]", slot: int, origin: Origin, timeout: float | None,
              connect_timeout: float) -> "RingBackend":
    """As a newcomer at `slot` of `origin` (lineage.py: the hostfile, or the store): wait up to
    connect_timeout to be taken in by a grow(), then form the grown ring (of class `ring`, passed
    in so that this module never imports the backend); returns this process's backend in it."""
    logs.apply_verbose_setting()  # MLX_RING_VERBOSE: the knock and the wait are logged too, not only the ring's forming
    auth, token = origin.auth(), origin.token()
    listeners: list[tcp.Listener] = []
    try:
        with origin.waiting(slot) as waiting:
            waiting.serve(auth, token, slot, admit_invitation, f"slot {slot} (waiting to join)")
            listeners = [tcp.Listener(host, 0) for host in origin.hosts(slot)]
            deadline = time.monotonic() + connect_timeout
            decision = enrolment.await_invitation(waiting, auth, slot, PURPOSE_GROW,
                                                  {"addrs": [s.where() for s in listeners]}, deadline)
    except BaseException:
        for s in listeners:
            s.close()
        raise
    slots, epoch = [int(s) for s in decision["slots"]], int(decision["epoch"])
    rank = slots.index(slot)
    key = enrolment.group_key(auth, bytes.fromhex(decision["nonce"]), epoch)
    grow_timeout = float(decision.get("timeout", max(1.0, connect_timeout - 5.0)))
    addresses = decision["addresses"]
    grown = Lineage(origin, slots, frozenset(decision.get("records", [])))
    started = time.monotonic()
    listeners[0].hold()  # if the formation fails here, this rank's seat in the agreement after it
    try:
        new = ring(rank, addresses, listeners, timeout, connect_timeout=grow_timeout + 5.0,
                          incarnation=epoch, job=key, decided=True)
    except DistributedError as exc:
        why = f"the group of {len(slots)} did not form after {time.monotonic() - started:.2f} s ({exc})"
        new = after_failure(ring, f"slot {slot}: grow epoch {epoch}", rank, addresses, listeners[0], key, epoch, timeout,
                            grow_timeout, grown, None, why, culprit_of(exc))
        log.info("slot %d: joined as rank %d of %d (after grow epoch %d lost a rank)", slot, new.rank(), new.size(),
                 epoch)
        return new
    except BaseException:
        listeners[0].release()
        listeners[0].close()
        raise
    listeners[0].release()
    lineage.record(new, grown)
    shrink.record_epoch(new, epoch)
    log.info("slot %d: joined as rank %d of %d (grow epoch %d)", slot, rank, len(slots), epoch)
    return new
