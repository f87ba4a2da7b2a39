"""grow() for JACCL on the TCP mesh: the members take in newcomers (replacements for dead ranks)
and form a fresh mesh with them; the newcomer's side is join_mesh().

A JACCL group knows one address: MLX_JACCL_COORDINATOR, where the job's first rank 0 listened for
the side channel. So a newcomer (a process started with JACKLRING_JOIN=1 and MLX_RANK = a
vacant slot, i.e. a rank of the job's first group that no member holds now) knocks there
(knock.py), and the recruiter is the member that can listen there: the process of the job's
first rank 0 (slot 0). It is always the members' rank 0 when it is a member (shrink and grow
keep the members' order); when slot 0 is vacant nobody can recruit, and grow() raises
DistributedError at once on every member.

The members call grow() together. They all-gather the addresses of fresh mesh listeners over
their group; rank 0 opens the Door at the coordinator address and takes knocks (each under the
job key) until it has `count` newcomers or `timeout` passes, then broadcasts the decision over
the members' group and sends it to each newcomer. The decision names the new ranks: the
members keep theirs (0..k-1) and the newcomers follow in ascending slot order. Everybody then
forms a mesh on the fresh listeners under a key derived from the job key, a fresh nonce and the
epoch (elastic/enrolment.group_key, as the ring's grow), so a process that was not told the
decision cannot connect to it. The grown group's device matrix is the job's device file's rows
and columns of its slots; shared memory attaches as at init. If too few newcomers knocked, the
ones that did are told the attempt is off (they knock again, until their deadline) and every
member raises CollectiveTimeout; the members' group stays as it was.

A death after the decision (a member or a newcomer) fails the formation: every rank still
forming sees the dead rank's listener refuse connections (a watch every 0.25 s) or its
connection end. It may have formed on some ranks all the same (a death inside the grown mesh's
closing all-gather), so a rank on which it did not form agrees in it as the ring's grow does
(elastic/shrinking.after_grow_failure, at its listener of the grown mesh, where a rank on
which it formed meets it when it shrinks that group): if any rank of the outcome formed it, they
all carry on in the mesh of the outcome; if none did, every member raises PeerError and keeps
its group as it was (its links are broken only once the grown mesh formed), and a newcomer's
init() raises.

RDMA groups do not grow (their queue pairs are created once from the device file), nor do
groups formed by split() (a sub-group holds no slots of the job's first group).
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ...errors import CollectiveTimeout, ConfigError, DistributedError, failure_of
from ..elastic import enrolment, shrinking
from ..transport import auth, mesh_forming, tcp
from . import knock, shrink
from .config import DeviceMatrix
from .shrink import watch

if TYPE_CHECKING:
    from ..transport.tcp_mesh import TcpMeshTransport

log = logging.getLogger("jacklring.grow")



@dataclass(frozen=True)
class Origin:
    """The job's first JACCL group: its coordinator address and its whole device file."""
    coordinator: str
    devices: DeviceMatrix

    def _context(self) -> bytes:
        return json.dumps([self.coordinator, self.devices]).encode()

    def auth(self) -> auth.Auth:
        """The job key a newcomer proves (the salt of init's: the secret is stretched once)."""
        return auth.job_auth(self._context(), "growing the JACCL group", salt=self._context())

    def token(self) -> int:
        """The job context id of the knocks."""
        return auth.context_id(json.dumps([self.coordinator, self.devices, "grow"]).encode())

    def group_token(self, epoch: int, nonce: str) -> int:
        """The job context id of the grown mesh of this decision."""
        return auth.context_id(json.dumps([self.coordinator, self.devices, "grown", epoch, nonce]).encode())


@dataclass(frozen=True)
class Lineage:
    origin: Origin
    slots: list[int]   # the slot (rank of the job's first group) each rank of this group holds

    def vacant(self) -> list[int]:
        held = set(self.slots)
        return [s for s in range(len(self.origin.devices)) if s not in held]

    def keep(self, ranks: list[int]) -> "Lineage":
        """The lineage of the group of these ranks (a shrink's members, in their order)."""
        return Lineage(self.origin, [self.slots[r] for r in ranks])

    def devices(self) -> DeviceMatrix:
        """The device file's rows and columns of this group's slots."""
        return [[self.origin.devices[a][b] for b in self.slots] for a in self.slots]


def hold_coordinator(origin: Origin, listener: tcp.Listener) -> None:
    """As the job's first rank 0, once the group formed: keep the coordinator address (the side
    channel's listener) bound for grows, answering "no grow in progress" meanwhile (knock.hold)."""
    knock.hold(origin.coordinator, listener, origin.auth(), origin.token(), 0)


# A grown group, from (its transport, lineage, mode, this rank's host, job context id, key): the
# caller's settings (timeouts, checks) complete it; it attaches shared memory (a collective of
# the new group).
Build = Callable[["TcpMeshTransport", Lineage, str, str, int, auth.Auth], object]


def grow_mesh(old, lin: Lineage, host: str, op_timeout: float, count: int | None, timeout: float, build: Build):
    """The mesh of the members and `count` newcomers (default: one per vacant slot), as this
    member's new backend (see the module docstring). old: the members' JacclBackend (on the TCP
    mesh, checked by the caller), whose operation timeout is op_timeout."""
    me = old.rank()
    vacant = lin.vacant()
    want = len(vacant) if count is None else int(count)
    if not 1 <= want <= len(vacant):
        raise ValueError(f"rank {me}: grow: count={count} but the job's first group has {len(vacant)} vacant "
                         f"slot(s) {vacant} (slots held: {lin.slots})")
    if lin.slots[0] != 0:
        raise DistributedError(
            f"rank {me}: grow: nobody can recruit: a JACCL newcomer knocks at MLX_JACCL_COORDINATOR="
            f"{lin.origin.coordinator}, where only the process of the job's first rank 0 (slot 0) can listen, and "
            f"it is no member any more (the members hold slots {lin.slots}); restart the job, or use the ring "
            f"backend, whose newcomers wait at their own slot's address")
    listener = mesh_forming.mesh_listener(host)
    epoch = shrinking.epoch_of(old) + 1
    door: knock.Door | None = None
    saved = op_timeout
    try:
        refused = None
        if me == 0:
            try:
                door = knock.Door(lin.origin.coordinator, lin.origin.auth(), lin.origin.token(), vacant, me)
            except DistributedError as exc:
                refused = str(exc)
        old.set_timeout(max(saved, timeout + 10.0))  # the others wait in the broadcast while rank 0 recruits
        members = enrolment.gather_addresses(old, [listener.where()])
        decision: dict = {}
        if me == 0:
            decision = ({"ok": False, "refused": True, "why": refused} if door is None else
                        _recruit(door, lin, vacant, want, [a[0] for a in members], epoch, timeout, old.mode))
        decision = enrolment.broadcast_decision(old, decision)
    except BaseException:
        listener.close()
        raise
    finally:
        if door is not None:
            door.close()
        old.set_timeout(saved)
    if not decision.get("ok"):
        listener.close()
        kind = DistributedError if decision.get("refused") else CollectiveTimeout
        raise kind(f"rank {me}: grow: {decision.get('why')} (decided by rank 0); this group stays as it was")
    slots = [int(s) for s in decision["slots"]]
    grown = Lineage(lin.origin, slots)
    new, formed = _form(me, f"rank {me}: grow epoch {epoch}", decision, grown, listener, host, build, old)
    if formed:
        old.break_links(f"rank {me}: this group grew into a group of {len(slots)} (epoch {epoch})")
        shrinking.record_epoch(new, epoch)
        log.info("rank %d: grow epoch %d: %d newcomer(s) from slots %s, %d ranks", me, epoch,
                 len(slots) - old.size(), slots[old.size():], len(slots))
    return new


def _recruit(door: knock.Door, lin: Lineage, vacant: list[int], want: int, members: list[str], epoch: int,
             timeout: float, mode: str) -> dict:
    """As rank 0: take knocks at the Door for `want` vacant slots within timeout; the decision
    (sent to each newcomer too), or {"ok": False, "why": ...}."""
    answer_timeout = min(1.0, max(0.05, timeout / 4))
    deadline = time.monotonic() + timeout
    found: dict[int, tuple] = {}
    why_not: dict[int, str] = {}
    while len(found) < want:
        taken = door.take(deadline)
        if taken is None:
            break
        channel, slot = taken
        if slot in found:  # a second process knocking for a slot already taken in this attempt
            channel.close()
            continue
        got = enrolment.invite(channel, slot, epoch, answer_timeout, timeout)
        if isinstance(got, str):
            why_not[slot] = got
            continue
        addrs = got[1].get("addrs")
        if not (isinstance(addrs, list) and len(addrs) == 1 and isinstance(addrs[0], str)):
            got[0].close()
            why_not[slot] = f"it accepted with {addrs!r}, not one mesh listener address"
            continue
        found[slot] = (got[0], addrs[0])
        why_not.pop(slot, None)
    tell_by = time.monotonic() + answer_timeout
    if len(found) < want:
        reasons = "; ".join(f"slot {s}: {why_not.get(s, 'no knock')}" for s in vacant if s not in found)
        why = (f"only {len(found)} of {want} newcomer(s) joined within {timeout:g} s (vacant slots {vacant}, "
               f"knocking at MLX_JACCL_COORDINATOR={door.where}: {reasons}){door.rejected()}")
        for channel, _ in found.values():
            enrolment.tell(channel, {"kind": "cancel", "why": why}, tell_by)
        return {"ok": False, "why": why}
    newcomers = sorted(found)
    decision = {"ok": True, "kind": "decision", "epoch": epoch, "nonce": os.urandom(16).hex(), "timeout": timeout,
                "mode": mode, "slots": lin.slots + newcomers, "addresses": members + [found[s][1] for s in newcomers]}
    for s in newcomers:
        failed = enrolment.tell(found[s][0], decision, tell_by)
        if failed is not None:
            log.info("rank 0: grow epoch %d: the newcomer at slot %d was not told: %s", epoch, s, failed)
    return decision


def _form(rank: int, where: str, decision: dict, grown: Lineage, listener: tcp.Listener, host: str, build: Build,
          old) -> tuple[object, bool]:
    """The grown mesh (this process is its rank `rank`) on `listener`, built into a backend, and
    True. When it does not form here, the agreement after it (shrinking.after_grow_failure, at
    `listener`): the group of its outcome (its epoch recorded, a member's `old` broken) and False,
    or PeerError when nobody formed it (a member, whose group before the grow is `old`, keeps
    that; a newcomer, `old` None, was not taken in)."""
    addresses = [str(a) for a in decision["addresses"]]
    size, epoch, nonce = len(addresses), int(decision["epoch"]), str(decision["nonce"])
    mode, timeout = str(decision.get("mode", "mesh")), float(decision.get("timeout", 10.0))
    key = enrolment.group_key(grown.origin.auth(), bytes.fromhex(nonce), epoch)
    token = grown.origin.group_token(epoch, nonce)

    def exchange(blob: bytes) -> list[bytes]:  # the decision already holds every address
        return [json.dumps({"addr": a}).encode() for a in addresses]

    peers = {f"rank {q} (slot {grown.slots[q]}, {a})": a for q, a in enumerate(addresses) if q != rank}
    started = time.monotonic()
    listener.hold()  # if the formation fails here, this rank's seat in the agreement after it
    try:
        transport = mesh_forming.connect_mesh(rank, size, [p for p in range(size) if p != rank], host, exchange, token,
                                          started + timeout + 5.0, key, watch=watch(where, "the grown mesh", peers),
                                          listener=listener)
        new = build(transport, grown, mode, host, token, key)
    except DistributedError as exc:
        why = (f"the grown group of {size} (slots {grown.slots}) did not form after "
               f"{time.monotonic() - started:.2f} s ({exc})")
        seat = shrinking.unformed_seat(rank, addresses, listener, key, token, mesh_forming.PURPOSE_SHRINK, epoch)

        def reform(members: list[int], transport: "TcpMeshTransport", token: int, key: auth.Auth):
            return build(transport, grown.keep(members), mode, host, token, key)

        new, members = shrinking.after_grow_failure(where, seat, size, shrink.mesh_parts(host, reform), old,
                                                    None if old is None else old.break_links, timeout, epoch, why,
                                                    _culprit_or_mesh_rank(exc))
        log.info("%s: the group of %d did not form here; its ranks %s carry on as a group of %d", where, size,
                 members, new.size())
        return new, False
    except BaseException:
        listener.release()
        listener.close()
        raise
    listener.release()  # the grown group's own now: it closes with it
    return new, True


def join_mesh(slot: int, origin: Origin, connect_timeout: float, build: Build):
    """As a newcomer at `slot` of the job's first group: knock at the coordinator address until
    a grow() takes this process in (up to connect_timeout), then form the grown mesh; returns
    this process's backend in it."""
    if slot == 0:
        raise ConfigError(f"slot 0: JACKLRING_JOIN=1 with MLX_RANK=0: the job's first rank 0 is the one that "
                          f"recruits newcomers (at MLX_JACCL_COORDINATOR={origin.coordinator}), so nobody could "
                          f"take in its replacement; restart the job")
    # A newcomer on another host than the coordinator's would grow the group across hosts: the
    # same refusal as at init without a secret (open_hosts.py); the recruiter checks knocks too.
    coordinator_host = tcp.parse_address(origin.coordinator, "MLX_JACCL_COORDINATOR")[0]
    if not tcp.own_address(coordinator_host):
        auth.refuse_unauthenticated_hosts(
            f"slot {slot}: MLX_JACCL_COORDINATOR={origin.coordinator} names a host other than this one",
            [coordinator_host], "MLX_JACCL_COORDINATOR and MLX_IBV_DEVICES", "JACCL group")
    listener: tcp.Listener | None = None

    def listen(host: str) -> str:
        nonlocal listener
        if listener is None:
            listener = mesh_forming.mesh_listener(host)
        return listener.where()

    try:
        decision = knock.knock(origin.coordinator, slot, origin.auth(), origin.token(), listen,
                               time.monotonic() + connect_timeout)
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    assert listener is not None  # a decision came through a knock, which opened it
    slots = [int(s) for s in decision["slots"]]
    rank, epoch = slots.index(slot), int(decision["epoch"])
    host = tcp.parse_address(listener.where())[0]
    new, formed = _form(rank, f"slot {slot}: grow epoch {epoch}", decision, Lineage(origin, slots), listener, host,
                        build, None)
    if formed:
        shrinking.record_epoch(new, epoch)
    log.info("slot %d: joined as rank %d of %d (grow epoch %d)", slot, new.rank(), new.size(), epoch)
    return new


def _culprit_or_mesh_rank(exc: BaseException) -> int | None:
    """The rank a failed formation blames, else the one its mesh connected to or waited for."""
    culprit = failure_of(exc).culprit
    return culprit if culprit is not None else getattr(exc, "mesh_rank", None)
