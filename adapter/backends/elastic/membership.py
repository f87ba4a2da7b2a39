"""Agreement on who is still in a group after a failure: the backend-neutral half of shrink().

Every surviving old member runs agree(). Each one contacts the old members in rank order (an
authenticated connection to the peer's listener, hello purpose `seat.purpose`) and joins the
first that answers; a rank that reaches no lower rank is the coordinator. The coordinator
collects joins until every old member has joined, is proven dead (its listener refuses a
connection: the process is gone) or the window ends; the ones that joined are the new group if
there are enough of them (quorum), and it sends that decision, with an epoch number and a fresh
nonce (the seed of the new group's key), to each of them. A joiner whose coordinator dies or
stalls (the connection ends, or no answer within the window) moves on to the next rank; when the
coordinator took its join and died, it first asks the other members whether a decision was made
(a member that was told answers). A rank that has the decision answers later joins and questions
at its listener of the group it leaves with the outcome (Tombstone), so a rank that was only
stopped learns that it was excluded instead of forming a group of its own, and one whose
coordinator died before telling it learns the decision.

Every frame after the handshake carries a MAC under a key of that connection alone (from the job
key and both handshake nonces), so nobody without the job key can forge or alter a decision.
"""
from __future__ import annotations

import json
import logging
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from ...errors import CollectiveTimeout, DistributedError, ExcludedError, PeerError, QuorumError
from ..transport import tcp
from ..transport.auth import MAC_BYTES, Auth, equal
from ..transport.handshake import HandshakeRetry, OtherJob

log = logging.getLogger("jacklring.shrink")

LENGTH = struct.Struct("<I")
MAX_FRAME = 1 << 16
PROBE_EVERY_S = 0.1     # how often the coordinator checks whether a silent member's process is gone
POLL_S = 0.05           # how long the coordinator waits for a join between probes
HANDSHAKE_RETRIES = 3   # a listener over its handshake budget closes unread: try again this often
REPLACED_AFTER_S = 0.25  # a silent member whose address accepts is asked once, this far in, who listens there


@dataclass(frozen=True)
class Seat:
    """This rank's place in the old group: what agreement needs from the backend."""
    rank: int
    addresses: list[str]      # every old member's listener ("ip:port"), by old rank
    listener: tcp.Listener    # this rank's listener, serving, admitting hellos of `purpose`
    auth: Auth                # the old group's key
    token: int                # the old group's job context id
    purpose: int              # the hello purpose of shrink connections
    # A seat in a group that did not form (shrinking.py): the rank in the group shrink() was
    # called on of each rank here, so that errors name ranks the caller knows. None: the same.
    names: list[int] | None = None

    def name(self, q: object) -> object:
        """Rank q of this group as the caller knows it (q unchanged if it is not a rank here)."""
        return self.names[q] if self.names is not None and isinstance(q, int) and 0 <= q < len(self.names) else q

    def names_of(self, ranks: object) -> object:
        return [self.name(q) for q in ranks] if isinstance(ranks, list) else ranks


@dataclass(frozen=True)
class Decision:
    epoch: int
    members: list[int]              # old ranks, ascending: the new group's ranks 0..k-1
    payloads: dict[int, dict]       # old rank -> what it sent with its join (e.g. new addresses)
    nonce: bytes                    # fresh per decision: seeds the new group's key
    coordinator: int
    # old rank left out by exclude= -> the members whose exclude= named it (their request counted)
    excluded_by: dict[int, list[int]] = field(default_factory=dict)

    def message(self) -> dict:
        """The decision as the coordinator sends it."""
        return {"kind": "decision", "epoch": self.epoch, "members": self.members, "coordinator": self.coordinator,
                "nonce": self.nonce.hex(), "payloads": {str(q): p for q, p in self.payloads.items()},
                "excluded_by": {str(q): by for q, by in self.excluded_by.items()}}

    def exclusion(self) -> dict:
        """What a rank left out is told."""
        return {"kind": "excluded", "epoch": self.epoch, "members": self.members, "coordinator": self.coordinator,
                "excluded_by": {str(q): by for q, by in self.excluded_by.items()}}

    def key(self, auth: Auth) -> Auth:
        """The new group's key: only members (told the nonce) and the job key's holders can compute it."""
        return auth.derive(b"jacklring-shrink-group\0" + self.nonce + str(self.epoch).encode())


class Channel:
    """Length-prefixed JSON frames with a MAC each, over one authenticated connection."""

    def __init__(self, sock: socket.socket, auth: Auth, session: bytes, connector: bool, who: str) -> None:
        self.sock, self.who = sock, who
        self._key = auth.derive(b"jacklring-shrink-frames\0" + session)
        self._out_tag, self._in_tag = (b"C", b"A") if connector else (b"A", b"C")
        self._sent = self._received = 0

    def send(self, message: dict, deadline: float) -> None:
        data = json.dumps(message).encode()
        mac = self._key.mac(self._out_tag, str(self._sent).encode(), b"\0", data)
        self._sent += 1
        tcp.send_all(self.sock, LENGTH.pack(len(data)) + data + mac, deadline, self.who)

    def recv(self, deadline: float) -> dict:
        """The next frame; PeerError on a closed connection or a bad MAC, CollectiveTimeout at the deadline."""
        head = bytearray(LENGTH.size)
        tcp.recv_exact(self.sock, memoryview(head), deadline, self.who)
        (size,) = LENGTH.unpack(head)
        if size > MAX_FRAME:
            raise PeerError(f"{self.who} sent a {size}-byte shrink frame (at most {MAX_FRAME})")
        body = bytearray(size + MAC_BYTES)
        tcp.recv_exact(self.sock, memoryview(body), deadline, self.who)
        data, mac = bytes(body[:size]), bytes(body[size:])
        if not equal(mac, self._key.mac(self._in_tag, str(self._received).encode(), b"\0", data)):
            raise PeerError(f"{self.who} sent a shrink frame that failed its MAC")
        self._received += 1
        try:
            message = json.loads(data)
        except ValueError:
            raise PeerError(f"{self.who} sent a shrink frame that is not JSON") from None
        if not isinstance(message, dict):
            raise PeerError(f"{self.who} sent a shrink frame that is not an object")
        return message

    def closed(self) -> bool:
        """Whether the peer has gone (end of stream or error), looking without blocking."""
        try:
            self.sock.settimeout(0.0)  # with a timeout set, recv would wait despite MSG_DONTWAIT
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()


def refuses(address: str) -> bool:
    """Whether nothing listens at address any more: the process that held it is gone. A stopped
    process's kernel still accepts, so silence is never taken for death here."""
    try:
        with socket.create_connection(tcp.parse_address(address), timeout=0.2):
            return False  # connected and closed without a word: the listener drops it quietly
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def replaced(seat: Seat, peer: int, answer_timeout: float) -> bool:
    """Whether a process of another job context now listens at peer's address: a replacement
    started in its slot (grow's newcomer), so the member itself is gone. A live member completes
    the handshake (its listener then holds an idle connection that nobody reads, which is cheap
    and quiet, where a handshake broken off would be logged as a rejection)."""
    address = seat.addresses[peer]
    try:
        sock = socket.create_connection(tcp.parse_address(address), timeout=answer_timeout)
    except OSError:
        return False
    try:
        hello = tcp.Hello(seat.purpose, seat.rank, peer, 0, seat.token).fresh()
        tcp.client_handshake(sock, hello, seat.auth, address, f"rank {peer} ({address})", answer_timeout)
    except OtherJob:
        return True
    except (HandshakeRetry, DistributedError, OSError):
        return False
    finally:
        sock.close()
    return False


def _reach(seat: Seat, peer: int, answer_timeout: float) -> Channel | None:
    """An authenticated connection to peer's listener, or None when it is gone or does not answer."""
    address = seat.addresses[peer]
    who = f"rank {peer} ({address})"
    # Its Unix socket where it is on this host (tcp.open_to: counted by uid there, so a flood from 127.0.0.1 cannot spend
    # its handshakes); a listener over its budget closes unread: try again, a little later, until this answer's window ends.
    until = time.monotonic() + answer_timeout * HANDSHAKE_RETRIES
    pause = 0.01
    while True:
        try:
            sock = tcp.open_to(address, answer_timeout)
        except OSError:
            return None
        try:
            hello = tcp.Hello(seat.purpose, seat.rank, peer, 0, seat.token).fresh()
            done = tcp.client_handshake(sock, hello, seat.auth, address, who, answer_timeout)
        except HandshakeRetry:
            sock.close()
            if time.monotonic() + pause >= until:
                return None
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
            continue
        except (DistributedError, OSError) as exc:
            log.debug("rank %d: shrink: %s did not answer: %s", seat.rank, who, exc)
            sock.close()
            return None
        sock.settimeout(None)
        return Channel(sock, seat.auth, done.session, True, who)


def _excluded(seat: Seat, message: dict) -> ExcludedError:
    by = message.get("excluded_by")
    asked = by.get(str(seat.rank)) if isinstance(by, dict) else None
    why = (f"exclude= named it, at the request of old ranks {seat.names_of(sorted(asked))}" if asked else
           "it did not answer in time (it was stopped, too slow or cut off)")
    return ExcludedError(
        f"rank {seat.name(seat.rank)} was excluded from the group by shrink (epoch {message.get('epoch')}): {why}; "
        f"old ranks {seat.names_of(message.get('members'))} carry on without it (coordinator rank "
        f"{seat.name(message.get('coordinator'))}); this process must not rejoin: stop it, or start a new job")


def counted_exclusions(coordinator: int, requests: dict[int, Sequence[int]]) -> dict[int, list[int]]:
    """Which exclusion requests count, and whose: {excluded rank: the members that asked}.
    requests: joined member -> the ranks its exclude= named. The coordinator's request counts
    first, then the others' in rank order, each only if no request counted so far names its
    sender: a rank that the others already count as failed (a stopped rank that resumed and
    blamed a neighbour whose link closed under it) must not evict a rank they can reach."""
    by: dict[int, list[int]] = {}
    for asker in [coordinator] + sorted(q for q in requests if q != coordinator):
        if asker in by or asker not in requests:
            continue
        for q in requests[asker]:
            if q != asker:
                by.setdefault(int(q), []).append(asker)
    return by


def agree(seat: Seat, size: int, payload: dict, exclude: Sequence[int], min_size: int | None,
          window: float, epoch_floor: int) -> Decision:
    """Run the agreement (see the module docstring) as old rank seat.rank of `size`; returns the
    decision if this rank is in it. ExcludedError if it is not, QuorumError if too few answered.
    window: how long the coordinator waits for a member that neither joins nor is proven dead."""
    answer_timeout = min(1.0, max(0.05, window / 4))
    excluded = set(exclude) - {seat.rank}  # blamed itself (it was stopped): it learns the outcome by joining
    join = {"kind": "join", "rank": seat.rank, "payload": payload, "exclude": sorted(excluded),
            "epoch": epoch_floor}
    unreachable: set[int] = set()
    for candidate in range(size):
        if candidate in excluded:
            continue
        if candidate == seat.rank:
            return _coordinate(seat, size, join, unreachable, min_size, window, answer_timeout)
        channel = _reach(seat, candidate, answer_timeout)
        if channel is None:
            unreachable.add(candidate)
            continue
        try:
            # The coordinator may itself wait out its window, then form the group (the answer of a
            # rank that joined someone else comes once its own shrink is done).
            deadline = time.monotonic() + 2 * window + 3 * answer_timeout + 1.0
            channel.send(join, deadline)
            answer = channel.recv(deadline)
        except DistributedError as exc:
            log.debug("rank %d: shrink: coordinator candidate rank %d gave no answer: %s", seat.rank, candidate, exc)
            unreachable.add(candidate)
            # It took the join and went without an answer: it may have decided and told others
            # before it died. A member that was told answers at its seat (its tombstone).
            told = _ask_told(seat, size, excluded | unreachable | {seat.rank}, answer_timeout)
            if told is None:
                continue
            log.debug("rank %d: shrink: coordinator rank %d died; rank %s says it decided", seat.rank, candidate,
                      told.get("coordinator"))
            answer = told
        finally:
            channel.close()
        kind = answer.get("kind")
        if kind == "no-quorum":
            raise QuorumError(f"rank {seat.name(seat.rank)}: shrink: {answer.get('why')} (decided by rank "
                              f"{seat.name(candidate)})")
        if kind == "excluded" or (kind == "decision" and seat.rank not in answer.get("members", [])):
            raise _excluded(seat, answer)
        if kind == "decision":
            return _parse_decision(answer)
        unreachable.add(candidate)
    raise PeerError(f"rank {seat.rank}: shrink: no rank answered")  # unreachable: this rank coordinates


def _ask_told(seat: Seat, size: int, skip: set[int], budget: float) -> dict | None:
    """The outcome ("decision" or "excluded") that a member which has moved on from this group
    gives within `budget`, asking every old member not in `skip` at once; None when nobody does.
    A member still agreeing leaves the question unanswered (a coordinator drops it: it is no
    join), so only an outcome that exists is learnt."""
    end = time.monotonic() + budget
    asked: list[Channel] = []
    try:
        for q in range(size):
            left = end - time.monotonic()
            if q in skip or left <= 0:
                continue
            channel = _reach(seat, q, left)
            if channel is None:
                continue
            try:
                channel.send({"kind": "ask", "rank": seat.rank}, end)
            except DistributedError:
                channel.close()
                continue
            asked.append(channel)
        while asked and time.monotonic() < end:
            readable, _, _ = select.select([c.sock for c in asked], [], [], max(0.0, end - time.monotonic()))
            for channel in [c for c in asked if c.sock in readable]:
                asked.remove(channel)
                try:
                    answer = channel.recv(max(end, time.monotonic() + 0.1))
                except DistributedError:
                    continue
                finally:
                    channel.close()
                if answer.get("kind") in ("decision", "excluded"):
                    return answer
    finally:
        for channel in asked:
            channel.close()
    return None


def _parse_decision(message: dict) -> Decision:
    by = message.get("excluded_by") or {}
    return Decision(int(message["epoch"]), [int(q) for q in message["members"]],
                    {int(q): p for q, p in message["payloads"].items()}, bytes.fromhex(message["nonce"]),
                    int(message["coordinator"]), {int(q): [int(a) for a in b] for q, b in by.items()})


def _coordinate(seat: Seat, size: int, mine: dict, unreachable: set[int], min_size: int | None,
                window: float, answer_timeout: float) -> Decision:
    me = seat.rank
    joins: dict[int, dict] = {me: mine}
    channels: dict[int, Channel] = {}
    requests: dict[int, list[int]] = {me: [int(q) for q in mine["exclude"]]}
    excluded_by = counted_exclusions(me, requests)
    excluded = set(excluded_by)
    dead: set[int] = set()
    started = time.monotonic()
    end = started + window
    next_probe = 0.0
    asked: set[int] = set()  # members asked once who listens at their address (replaced())

    def pending() -> list[int]:
        return [q for q in range(size)
                if q not in joins and q not in excluded and q not in dead and q not in unreachable]

    def take(until: float) -> bool:
        taken = seat.listener.take(lambda h: h.purpose == seat.purpose, until, None)
        if taken is None:
            return False
        sock, hello = taken
        channel = Channel(sock, seat.auth, hello.session, False, f"rank {hello.sender}")
        try:
            join = channel.recv(time.monotonic() + answer_timeout)
            if join.get("kind") != "join" or join.get("rank") != hello.sender:
                raise PeerError(f"rank {hello.sender} sent {join.get('kind')!r}, not a join")
        except DistributedError as exc:
            log.debug("rank %d: shrink: the join of rank %d was lost: %s", me, hello.sender, exc)
            channel.close()
            return True
        old = channels.pop(hello.sender, None)
        if old is not None:
            old.close()
        joins[hello.sender], channels[hello.sender] = join, channel
        requests[hello.sender] = [int(q) for q in join.get("exclude", [])]
        excluded_by.clear()
        excluded_by.update(counted_exclusions(me, requests))
        excluded.clear()
        excluded.update(excluded_by)
        return True

    log.debug("rank %d: shrink: coordinating (unreachable: %s)", me, sorted(unreachable))
    while pending() and time.monotonic() < end:
        now = time.monotonic()
        if now >= next_probe:
            dead.update(q for q in pending() if refuses(seat.addresses[q]))
            if now - started >= REPLACED_AFTER_S:
                for q in [q for q in pending() if q not in asked]:
                    asked.add(q)
                    if replaced(seat, q, answer_timeout):
                        dead.add(q)
            next_probe = now + PROBE_EVERY_S
        take(min(end, time.monotonic() + POLL_S))
    while take(time.monotonic()):  # joins that are already queued still count
        pass
    log.debug("rank %d: shrink: joined %s, dead %s", me, sorted(joins), sorted(dead))
    for q, channel in list(channels.items()):
        if channel.closed():  # joined, then died (or gave up on this rank) before the decision
            channel.close()
            del channels[q], joins[q]
            requests.pop(q, None)
    excluded_by = counted_exclusions(me, requests)
    excluded = set(excluded_by)
    members = sorted(q for q in joins if q not in excluded)
    contenders = size - len(excluded)
    need = min_size if min_size is not None else contenders // 2 + 1
    epoch = max(int(j.get("epoch", 0)) for j in joins.values())
    missing = sorted(set(range(size)) - set(members) - excluded)
    if len(members) < need and not channels:
        # Nobody joined: this rank may be the one left behind (a stopped rank 0 resumed after
        # the others shrank without it). A survivor's old listener tells it so.
        outcome = _ask_outcome(seat, size, mine, excluded | dead | {me}, answer_timeout)
        if outcome is not None and outcome.get("kind") == "decision" and me in outcome.get("members", []):
            return _parse_decision(outcome)
        if outcome is not None and outcome.get("kind") in ("decision", "excluded"):
            raise _excluded(seat, outcome)
    if len(members) < need:
        rule = (f"min_size={min_size}" if min_size is not None else
                f"more than half of the {contenders} old members that exclude= did not name")
        why = (f"only old ranks {seat.names_of(members)} answered ({len(members)} of {size}; missing "
               f"{seat.names_of(missing)}), and a new group "
               f"needs at least {need} ({rule}): a minority must not carry on as the job (pass min_size= to allow it)")
        _answer(channels, {"kind": "no-quorum", "why": why})
        raise QuorumError(f"rank {seat.name(me)}: shrink: {why}")
    made = Decision(epoch, members, {q: joins[q]["payload"] for q in members}, os.urandom(16), me,
                    {q: by for q, by in excluded_by.items() if q not in members})
    decision = made.message()
    _answer(channels, decision, made.exclusion())
    log.info("rank %s: shrink epoch %d: members %s (out: %s)", seat.name(me), epoch, seat.names_of(members),
             seat.names_of(missing + sorted(excluded)))
    if me not in members:
        raise _excluded(seat, decision)
    return _parse_decision(decision)


def _ask_outcome(seat: Seat, size: int, join: dict, skip: set[int], answer_timeout: float) -> dict | None:
    """The first answer another old member gives to a join within answer_timeout (a finished
    survivor answers at once; one still agreeing holds the connection), or None."""
    for q in range(size):
        if q in skip:
            continue
        channel = _reach(seat, q, answer_timeout)
        if channel is None:
            continue
        try:
            channel.send(join, time.monotonic() + answer_timeout)
            return channel.recv(time.monotonic() + answer_timeout)
        except DistributedError:
            continue
        finally:
            channel.close()
    return None


def _answer(channels: dict[int, Channel], message: dict, to_excluded: dict | None = None) -> None:
    deadline = time.monotonic() + 1.0
    for q, channel in channels.items():
        text = message if to_excluded is None or q in message.get("members", []) else to_excluded
        try:
            channel.send(text, deadline)
        except DistributedError:
            pass  # it died after joining: the new group's formation fails and the survivors agree again
        finally:
            channel.close()


class Tombstone:
    """Once this rank has left a group for the one a decision named: answer every later join at
    its listener in the group it left with the outcome, so a rank that was stopped or slow
    learns that it was excluded, and a member that missed the decision (its coordinator died
    before telling it) learns the decision. Ends when the listener closes."""

    def __init__(self, seat: Seat, decision: Decision) -> None:
        self._seat = seat
        self._answer = decision.exclusion()
        self._members, self._decision = set(decision.members), decision.message()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"jacklring-shrink-tombstone rank {seat.rank}",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        seat = self._seat
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                taken = seat.listener.take(lambda h: h.purpose == seat.purpose, started + 0.5, None)
            except (AssertionError, OSError):
                return  # the old group was closed
            if taken is None:
                if time.monotonic() - started < 0.1:
                    self._stop.wait(0.5)  # a closed listener answers at once
                continue
            sock, hello = taken
            channel = Channel(sock, seat.auth, hello.session, False, f"rank {hello.sender}")
            try:
                channel.recv(time.monotonic() + 1.0)
                channel.send(self._decision if hello.sender in self._members else self._answer,
                             time.monotonic() + 1.0)
            except (DistributedError, CollectiveTimeout):
                pass
            finally:
                channel.close()

    def close(self) -> None:
        self._stop.set()
