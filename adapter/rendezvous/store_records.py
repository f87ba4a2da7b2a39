"""Authenticated records in a c10d store (torch's TCPStore has no authentication).

The store ring publishes one record per rank: its listening address, MACed under the job key
and bound to the record's own key name, so a value an outsider wrote (or one replayed from
another group or generation) is recognised and reported as tampering, naming the key.

A MAC cannot tell a record of this run from the same key's record of an earlier run of the same
job (torchrun's default run id, plain env://: the names repeat, and so does the key when the
secret does). So every record also carries a nonce its rank drew for this formation, and before
any rank connects, each publishes a seal: the nonces of every record it read, MACed (seal()).
A record replayed from an earlier run holds that run's nonce, which no seal of this run's ranks
holds: the seals disagree and the rank reports a tampered record at that key, instead of
dialling the address in it (whoever listens there would receive a proof).

Which records belong to the current formation is never read from a counter in the store (one
`add` by an outsider, or a rank that died between its `add` and its record, would put ranks
on different generations). A formation's tag follows from what every rank of the formation
knows without the store: torchrun's run id and restart attempt when present, and how many
formations of this group this process has run (destroy_process_group + init again on a
store that outlives the group).
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..backends.transport import auth
from ..errors import DistributedError, IntegrityError

log = logging.getLogger("jacklring.torch")

RECORD_VERSION = "jr1"
MAX_RECORD_BYTES = 4096
TAMPER_GRACE_S = 5.0    # how long a value failing its MAC may stay before the rank reports it
POLL_S = (0.1, 0.25, 0.5, 1.0)  # between checks for tampered values (absent keys wake the wait)
DEFEND_S = 0.05         # how often a rank's record is put back while its peers may still read it
ABSENT = b"\0jacklring-absent"  # what read() sees for a missing key (compare_set's answer then)

_formations: dict[str, int] = {}
_formations_lock = threading.Lock()


def formation_tag(scope: str, environ=os.environ) -> str:
    """The tag of this process's next formation of `scope` (a group name and size): the same on
    every rank of the formation, different from every earlier formation on the same store."""
    with _formations_lock:
        count = _formations.get(scope, 0)
        _formations[scope] = count + 1
    parts = []
    restart = environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None:
        run_id = environ.get("TORCHELASTIC_RUN_ID", "")
        parts.append("r" + hashlib.sha256(run_id.encode()).hexdigest()[:12])
        parts.append(f"a{restart.strip()}")
    parts.append(f"f{count}")
    return ".".join(parts)


def read(store, name: str) -> bytes | None:
    """The value at `name`, or None when there is none, without blocking and without changing
    the store: get() waits for a missing key for the store's whole timeout (an outsider who
    deletes a key would stall the reader), and check() then get() races with a deletion.
    compare_set with an expected value that is never stored answers a missing key with that
    value and leaves every other key as it is."""
    value = bytes(store.compare_set(name, ABSENT, ABSENT))
    return None if value == ABSENT else value


@dataclass(frozen=True)
class Misfit:
    """A record that checked but does not belong to this run: why, the key of the record the
    tampering is at (not always the key it was read from: a seal shows tampering at a record),
    and whether its owner may still put it right (a replayed record its owner writes back)."""
    why: str
    key: str
    grace: bool


class _Misfitting(IntegrityError):
    def __init__(self, misfit: Misfit) -> None:
        super().__init__(misfit.why)
        self.misfit = misfit


@dataclass(frozen=True)
class Record:
    rank: int
    value: str  # what the book's `what` names: a listening address, an NCCL id in hex
    run: str = ""  # the nonce its rank drew for this formation (hex)


class RecordBook:
    """The records of one formation: key names under `prefix`, MACs under `key`. `what` names
    the value each record holds (its JSON field, and the words of errors): "address" for the
    store ring, "nccl_id" for NCCL's unique id; each kind has a MAC key of its own, so a record
    of one kind never passes as another."""

    def __init__(self, store, prefix: str, key: auth.Auth, rank: int, size: int, what: str = "address",
                 belongs: "Callable[[Record], str | Misfit | None] | None" = None, run: str | None = None) -> None:
        self._store = store
        # why a record that checked does not belong to this run (a Misfit: where the tampering
        # is, and whether its owner could still put it right), or None
        self._belongs = belongs
        self.run = run or secrets.token_hex(16)  # this rank's nonce for this formation, in its record
        self._prefix = prefix
        self._what = what
        self._key = key.derive(b"store-record" if what == "address" else b"store-record:" + what.encode())
        self._rank = rank
        self._size = size
        self.tampered = 0   # how often this rank found its own record deleted or overwritten

    def key_name(self, rank: int) -> str:
        return f"{self._prefix}{rank}"

    def _mac(self, name: str, body: bytes) -> str:
        return self._key.mac(b"jacklring-store-record\0", name.encode(), b"\0", body).hex()

    def encode(self, record: Record) -> bytes:
        name = self.key_name(record.rank)
        body = json.dumps({"rank": record.rank, "size": self._size, self._what: record.value, "run": record.run},
                          sort_keys=True, separators=(",", ":")).encode()
        return f"{RECORD_VERSION} {self._mac(name, body)} ".encode() + body

    def decode(self, q: int, raw: bytes) -> Record:
        """The record of rank q from the store's bytes; IntegrityError saying what is wrong."""
        name = self.key_name(q)
        raw = bytes(raw)
        limit = max(MAX_RECORD_BYTES, 40 * self._size + 256)  # a seal holds a nonce per rank
        if len(raw) > limit:
            raise IntegrityError(f"{len(raw)} bytes, more than a record ({limit})")
        version, _, rest = raw.partition(b" ")
        tag, _, body = rest.partition(b" ")
        if version != RECORD_VERSION.encode():
            raise IntegrityError("not a jacklring record")
        if not auth.equal(tag, self._mac(name, body).encode()):
            raise IntegrityError("its MAC does not match: not written by a rank holding the job key "
                                 "(or by a rank of another job)")
        fields = json.loads(body)
        if fields.get("rank") != q or fields.get("size") != self._size or not isinstance(fields.get(self._what), str):
            raise IntegrityError(f"it describes rank {fields.get('rank')} of {fields.get('size')}, "
                                 f"not rank {q} of {self._size}")
        run = fields.get("run")
        if not isinstance(run, str) or len(run) != 32:
            raise IntegrityError("it carries no nonce of a formation (a record of an older jacklring)")
        record = Record(q, fields[self._what], run)
        why = self._belongs(record) if self._belongs is not None else None
        if isinstance(why, Misfit):
            raise _Misfitting(why)
        if why is not None:
            raise IntegrityError(why)
        return record

    def publish(self, text: str) -> bytes:
        value = self.encode(Record(self._rank, text, self.run))
        self._store.set(self.key_name(self._rank), value)
        return value

    def gather(self, mine: bytes | None, wait_s: float, ranks: list[int] | None = None,
               watch: "Callable[[list[int]], None] | None" = None) -> list[Record]:
        """The records of `ranks` (default every rank), verified, in that order; `mine` is this
        rank's published record (defended meanwhile), None when it published none. Raises
        IntegrityError naming the key when a value fails its check for TAMPER_GRACE_S (its owner
        had that long to overwrite it), DistributedError naming the ranks that published nothing
        when wait_s passes. watch(missing) is called every round with the ranks whose record has
        not come (it may raise: a rank known to have left)."""
        wanted = list(range(self._size)) if ranks is None else list(ranks)
        start = time.monotonic()
        deadline = start + wait_s
        found: dict[int, Record] = {}
        bad: dict[int, tuple[float, str, str]] = {}  # rank -> (first seen, why, the tampered record's key)
        seen: set[int] = set()                  # ranks whose key held a value once
        rounds = 0
        if mine is not None and self._rank in wanted:
            # this rank's own record is what it wrote, never what the store holds at its key
            # now (an outsider may have put back this rank's record of an earlier run there)
            found[self._rank] = self.decode(self._rank, mine)
        while True:
            if mine is not None:
                self.defend(mine)
            for q in wanted:
                if q in found:
                    continue
                name = self.key_name(q)
                raw = read(self._store, name)
                if raw is None:
                    if q in seen:  # ranks never delete their records while a formation reads them
                        bad.setdefault(q, (time.monotonic(), "it was deleted after a value had been written there "
                                                             "(no rank deletes its record)", name))
                    continue
                seen.add(q)
                try:
                    found[q] = self.decode(q, raw)
                    if q in bad:
                        log.warning("rank %d: jacklring rendezvous: store key %r held a value that failed its "
                                    "check (%s) before rank %d's record replaced it", self._rank, name, bad[q][1], q)
                    bad.pop(q, None)
                except _Misfitting as exc:
                    misfit = exc.misfit
                    if not misfit.grace:  # no owner's rewrite can put it right: say so now
                        raise self._tampered(misfit.key, q, misfit.why, 0.0) from None
                    bad.setdefault(q, (time.monotonic(), misfit.why, misfit.key))
                except (IntegrityError, ValueError) as exc:
                    bad.setdefault(q, (time.monotonic(), str(exc), name))
            if len(found) == len(wanted):
                return [found[q] for q in wanted]
            now = time.monotonic()
            for q, (since, why, where) in sorted(bad.items()):
                if now - since >= TAMPER_GRACE_S or now >= deadline:
                    raise self._tampered(where, q, why, now - since)
            if now >= deadline:
                missing = [q for q in wanted if q not in found]
                if self.tampered:
                    raise IntegrityError(
                        f"rank {self._rank}: jacklring rendezvous: no record of ranks {missing} within {wait_s:g} s, "
                        f"while this rank's own record at key {self.key_name(self._rank)!r} was deleted or "
                        f"overwritten {self.tampered} times by someone else: the store is being tampered with, "
                        f"so their records may have been removed as well. Set a job secret and keep the "
                        f"store's port unreachable (docs/security.md)")
                raise DistributedError(f"rank {self._rank}: jacklring rendezvous: ranks {missing} did not "
                                       f"publish their {self._what} within {wait_s:g} s")
            if watch is not None:
                watch([q for q in wanted if q not in found and q not in bad])
            pause = min(POLL_S[min(rounds, len(POLL_S) - 1)], max(0.0, deadline - now))
            self._wait_briefly([q for q in wanted if q not in found and q not in bad], pause)
            rounds += 1

    def _tampered(self, where: str, q: int, why: str, lasted: float) -> IntegrityError:
        what = (f"the store value at key {self.key_name(q)!r} (rank {q}'s {self._what} record) was tampered with"
                if where == self.key_name(q) else f"rank {q}'s {self._what} at key {self.key_name(q)!r} shows it")
        return IntegrityError(
            f"rank {self._rank}: jacklring rendezvous: tampered record at key {where!r}: {what}: {why}"
            f"{f'; it stayed so for {lasted:.1f} s' if lasted else ''}. Someone other than the job's ranks writes "
            f"to the store (they can stop a formation, never join it): set a job secret and keep the store's port "
            f"unreachable (docs/security.md)")

    def _wait_briefly(self, absent: list[int], pause: float) -> None:
        """Until every absent key exists (the store wakes us at once) or pause passes."""
        if not absent:
            time.sleep(pause)  # only values failing their check remain: give their owners time
            return
        try:
            self._store.wait([self.key_name(q) for q in absent], datetime.timedelta(seconds=max(pause, 0.001)))
        except Exception:  # torch's DistStoreError on timeout; a closed store fails the next check()
            pass

    def defend(self, mine: bytes) -> None:
        """Put this rank's record back when someone deleted or overwrote it (the readers retry).
        Never blocks (read(), not get(), which would wait for a deleted key)."""
        name = self.key_name(self._rank)
        current = read(self._store, name)
        if current == mine:
            return
        self.tampered += 1
        if self.tampered == 1:
            log.warning("rank %d: jacklring rendezvous: store key %r was %s by someone else; writing this "
                        "rank's record again", self._rank, name, "deleted" if current is None else "overwritten")
        self._store.set(name, mine)

    @contextlib.contextmanager
    def defended(self, mine: bytes, every_s: float = DEFEND_S):
        """While the body runs (the ring connecting), keep this rank's record in place in a
        thread, for peers that have not read it yet: an outsider who deletes it right after
        this rank's gather would otherwise leave them waiting until their deadline."""
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(every_s):
                try:
                    self.defend(mine)
                except Exception:  # the store went away: the ring's own errors say why
                    return

        thread = threading.Thread(target=run, name=f"jacklring-defend-{self._rank}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(1.0)


def seal(store, prefix: str, key: auth.Auth, rank: int, records: list[Record], wait_s: float,
         names: Callable[[int], str], watch: "Callable[[list[int]], None] | None" = None
         ) -> tuple[RecordBook, bytes]:
    """Check that every rank read the same records (those of this run): each rank publishes the
    nonces of the records it read at `prefix`seal/RANK and reads everyone's. Returns the seal
    book and this rank's seal (keep it defended while peers may read it). IntegrityError naming
    the record's key when a rank read a record of another run (names(q): rank q's record key)."""
    runs = [r.run for r in records]
    size = len(runs)

    def belongs(sealed: Record) -> Misfit | None:
        # A seal of this run holds this rank's nonce: none from an earlier run can, since the
        # nonce was drawn after it. Its owner overwrites a replayed one (so the usual grace).
        theirs, q = sealed.value.split(","), sealed.rank
        if len(theirs) != size:
            return Misfit(f"it seals {len(theirs)} records, not {size}", f"{prefix}seal/{q}", True)
        if theirs[q] != runs[q]:  # a seal replayed here, or the record this rank read at q's key
            # A seal holding this rank's fresh nonce is of this run: then the record is the old one.
            return Misfit(f"rank {q}'s seal does not match the record of rank {q} this rank read at {names(q)!r}: "
                          f"a record or seal of an earlier run was written back", names(q),
                          theirs[rank] != runs[rank])
        if theirs[rank] != runs[rank]:  # rank q sealed its own record of this run, and another at ours
            return Misfit(f"rank {q} read a record of another run at {names(rank)!r}, not the one this rank "
                          f"wrote there in this run: someone wrote a record of an earlier run back", names(rank),
                          False)
        return None

    book = RecordBook(store, f"{prefix}seal/", key, rank, size, what="seal", belongs=belongs)
    mine = book.publish(",".join(runs))
    for sealed in book.gather(mine, wait_s, watch=watch):
        for q, (ours, theirs) in enumerate(zip(runs, sealed.value.split(","))):
            if ours != theirs:
                raise IntegrityError(
                    f"rank {rank}: jacklring rendezvous: tampered record at key {names(q)!r}: rank {sealed.rank} "
                    f"and this rank read different records of rank {q} there, both MACed under the job key: "
                    f"one is a record of an earlier run of this job written back by someone who read the store. "
                    f"Someone other than the job's ranks writes to the store: keep the store's port "
                    f"unreachable (docs/security.md)")
    return book, mine


def tell_tampering(store, prefix: str, key: auth.Auth, rank: int, size: int, run: str, text: str) -> None:
    """Best effort: leave this rank's tampering verdict (MACed, with its nonce of this run) where
    its peers look before they call it dead (told_tampering), so that they name the tampering
    too, not this rank's exit."""
    try:
        RecordBook(store, f"{prefix}tampered/", key, rank, size, what="tamper", run=run).publish(text[:1500])
    except Exception:  # the store is gone or refuses: the peers fall back to what they see
        pass


def told_tampering(store, prefix: str, key: auth.Auth, rank: int, size: int, q: int, run: str) -> str | None:
    """Rank q's tampering verdict of this formation (its record's nonce is `run`), or None."""
    book = RecordBook(store, f"{prefix}tampered/", key, rank, size, what="tamper")
    try:
        raw = read(store, book.key_name(q))
        told = None if raw is None else book.decode(q, raw)
    except Exception:  # a forged or unreadable value says nothing
        return None
    return told.value if told is not None and told.run == run else None


def wait_for(store, name: str, wait_s: float, rank: int, what: str) -> bytes:
    """The value at `name`, waiting up to wait_s for it to appear."""
    try:
        store.wait([name], datetime.timedelta(seconds=wait_s))
    except Exception as exc:
        raise DistributedError(f"rank {rank}: jacklring rendezvous: no {what} at store key {name!r} "
                               f"within {wait_s:g} s ({exc})") from None
    value = read(store, name)
    if value is None:
        raise IntegrityError(f"rank {rank}: jacklring rendezvous: the store value at key {name!r} ({what}) was "
                             f"tampered with: it was deleted right after it appeared")
    return value
