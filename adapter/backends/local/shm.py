"""Shared memory between the ranks of a group that run on one host (Linux).

One segment per host with several ranks of the group (the whole group, or some of its ranks when
the group spans hosts): a memfd created by the host's first rank and opened by the others through
/proc/<pid>/fd/<n> (only processes allowed to inspect that rank, i.e. the same user, can), so the
segment never has a name in /dev/shm and the kernel frees it when the last rank exits, kill -9
included. Layout: a control block per rank (step counter, the headers of its current
collective), then per rank two data buffers of `chunk_bytes` (even and odd steps).

Collectives are sequences of *steps*. In a step every rank writes its buffer of that step's
parity, publishes its step counter (a release store), and waits until every peer has published
the same step (acquire loads); then it may read the peers' buffers of that parity. A buffer is
rewritten two steps later, by which time every peer has published the step in between, so it
has finished reading. Every step is a full barrier, which is what makes that argument hold.

Waiting spins briefly (only when asked), then checks while giving the CPU away with
sched_yield() (when the host has a CPU for every rank of the segment: a peer waiting for this CPU
runs at once), then sleeps in a futex (futex.py) on the segment's arrival word: every rank adds
one to it after publishing its counter, and the rank whose addition completes a step (the word
reaches a multiple of the segment's size) wakes every sleeper with one system call. A waiter
announces its sleep in a shared bit mask (seq_cst fetch_or), reads the arrival word, re-checks
the counter it waits for, then sleeps while the arrival word is unchanged; the completing rank
adds (seq_cst) and reads the mask (seq_cst): either the waiter sees the counter, or the
completing addition comes later and sees the bit (no lost wake-up; FUTEX_WAIT itself refuses to
sleep once the word moved). So each sleeper wakes once per step, not once per arrival. Sleeps are
bounded: between them the waiter checks its deadline, the peers' "left after an error" words and,
without blocking, the peers' pidfds (readable the moment a peer exits) and the backend's sockets
(a peer that closed them broke the group), sooner at first and every 50 ms at most. Memory
ordering comes from atomic_words (C11 atomics), never from x86's store order.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import select
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ...errors import CollectiveTimeout, MismatchError, PeerError
from . import atomic_words, futex
from .atomic_words import ACQUIRE, SEQ_CST, AtomicWords

log = logging.getLogger("jacklring.shm")

MASK64 = (1 << 64) - 1
BEYOND = MASK64                 # a step no rank reaches
MAX_RANKS = 64                  # ranks per host: one bit per rank in the sleepers mask
SLEEPERS, ARRIVALS = 0, 64      # in the first control block: the sleepers mask, the arrival count
LIVENESS_FIRST_S, LIVENESS_MAX_S = 0.002, 0.05  # a sleeper's checks for dead peers, backing off
CONTROL = 128                   # bytes per control block (a cache line on Apple silicon)
COUNTER, BROKEN, HEADER = 0, 8, 16  # step counter, "left after an error" word, two headers (by parity)
# The "left after an error" word: 0 while the rank is in the group, else BROKEN_BASE + the rank it
# blamed (-1: its own error), so a peer that sees it can name the rank that died first.
BROKEN_BASE = 2
HEADER_BYTES = 24
RECORD_BYTES = 512              # fixed-size records exchanged while forming the group
PAGE = 4096


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _inode(path: str) -> str:
    try:
        st = os.stat(path)
        return f"{st.st_dev}:{st.st_ino}"
    except OSError:
        return ""


def host_identity() -> dict:
    """What must be equal for two processes to share memory and see each other's pids and
    abstract sockets: the same kernel boot, host name, pid and network namespaces, user."""
    return {
        "boot": _read("/proc/sys/kernel/random/boot_id"),
        "host": socket.gethostname(),
        "pidns": _inode("/proc/self/ns/pid"),
        "netns": _inode("/proc/self/ns/net"),
        "shm": _inode("/dev/shm"),
        "uid": os.getuid(),
    }


def unusable_here() -> str | None:
    """Why this process cannot take part in a shared-memory group, or None."""
    if sys.platform != "linux":
        return "shared memory is implemented for Linux only"
    if not hasattr(os, "pidfd_open") or not hasattr(os, "memfd_create"):
        return "this Python has no os.pidfd_open / os.memfd_create"
    why = atomic_words.available()
    if why:
        return why
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError as exc:
        return f"pidfd_open is unavailable ({exc.strerror})"
    return None


def _pack(record: dict) -> bytes:
    raw = json.dumps(record).encode()
    if len(raw) > RECORD_BYTES:
        raise ValueError(f"shared-memory set-up record too long ({len(raw)} bytes)")
    return raw.ljust(RECORD_BYTES, b"\0")


def _unpack(raw: bytes) -> dict:
    return json.loads(bytes(raw).rstrip(b"\0"))


@dataclass
class Placement:
    """Where a group's ranks are, as shared memory sees it, and this rank's segment."""
    hosts: list[list[int]]          # the ranks of each host in rank order, hosts by their first rank
    group: "SharedGroup | None"     # the segment of this rank's host, when it shares memory
    shared: bool                    # whether every host with several ranks shares memory (same everywhere)


def form(rank: int, size: int, gather: Callable[[bytes], list[bytes]], chunk_bytes: int,
         wanted: bool, describe: Callable[[bytes], str] = bytes.hex,
         mismatch: Callable[[int, int, bytes, bytes], str] | None = None) -> Placement:
    """Collectively decide whether the ranks that are on one host share memory and, if so,
    attach them: one segment per host with several ranks, created by its first rank.

    gather(record) exchanges RECORD_BYTES-byte records among all ranks (every rank calls form with
    the same arguments). The decision is the same on every rank: all hosts share memory or none
    does (shared=False, no group anywhere) when any rank cannot or does not want to.
    describe(header) words a collective's header in mismatch messages: the backend's format;
    mismatch(rank, peer, mine, theirs), when given, words the whole message instead (ranks of
    the whole group, both headers)."""
    why = None if wanted else "not wanted"
    why = why or unusable_here()
    ident = host_identity()
    records = [_unpack(r) for r in gather(_pack({"ok": why is None, "id": ident, "why": why}))]
    hosts = _by_host([r["id"] for r in records])
    nothing = Placement(hosts, None, False)
    if not all(r["ok"] for r in records):
        reasons = {f"rank {q}: {r['why']}" for q, r in enumerate(records) if not r["ok"]}
        log.debug("rank %d: no shared memory (%s)", rank, "; ".join(sorted(reasons)))
        return nothing
    if all(len(members) == 1 for members in hosts):
        log.debug("rank %d: no shared memory: no two ranks are on one host", rank)
        return nothing
    if max(len(members) for members in hosts) > MAX_RANKS:
        log.debug("rank %d: no shared memory: more than %d ranks on one host", rank, MAX_RANKS)
        return nothing
    members = next(m for m in hosts if rank in m)
    local = members.index(rank)
    total = SharedGroup.segment_bytes(len(members), chunk_bytes)
    fd = -1
    record: dict = {"ok": True, "pid": os.getpid()}
    try:
        if local == 0 and len(members) > 1:
            fd = os.memfd_create("jacklring-shm", os.MFD_CLOEXEC)
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, total)
            record.update(path=f"/proc/{os.getpid()}/fd/{fd}")
    except OSError as exc:
        record = {"ok": False, "why": f"rank {rank} cannot create the segment: {exc.strerror or exc}"}
    group = None
    try:
        second = [_unpack(r) for r in gather(_pack(record))]
        first = second[members[0]]
        mine: dict = {"ok": all(r["ok"] for r in second)}
        if mine["ok"] and len(members) > 1:
            try:
                group = SharedGroup(local, len(members), chunk_bytes, first["path"] if local else fd,
                                    [second[q]["pid"] for q in members], members, describe, mismatch)
            except Exception as exc:  # whatever it is, every rank must still reach the last exchange
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                mine = {"ok": False, "why": f"rank {rank} cannot attach: {why}"}
        third = [_unpack(r) for r in gather(_pack(mine))]
    finally:
        if fd >= 0:
            os.close(fd)  # the mappings keep the memory alive; nothing else refers to it now
    if not all(r["ok"] for r in third):
        if group is not None:
            group.close()
        reasons = {r.get("why", "?") for r in second + third if not r["ok"]}
        log.warning("rank %d: shared memory could not be set up (%s); using sockets", rank, "; ".join(sorted(reasons)))
        return nothing
    return Placement(hosts, group, True)


def _by_host(identities: list[dict]) -> list[list[int]]:
    hosts: dict[str, list[int]] = {}
    for q, ident in enumerate(identities):
        hosts.setdefault(json.dumps(ident, sort_keys=True), []).append(q)
    return list(hosts.values())  # insertion order: by first rank


class SharedGroup:
    """One group's segment, step counters, wake-ups and liveness watch."""

    @staticmethod
    def segment_bytes(size: int, chunk_bytes: int) -> int:
        return SharedGroup._data_offset(size) + size * 2 * chunk_bytes

    @staticmethod
    def _data_offset(size: int) -> int:
        return -(-(CONTROL * (size + 1)) // PAGE) * PAGE

    def __init__(self, rank: int, size: int, chunk_bytes: int, segment: int | str,
                 pids: list[int], names: list[int] | None = None,
                 describe: Callable[[bytes], str] = bytes.hex,
                 mismatch: Callable[[int, int, bytes, bytes], str] | None = None) -> None:
        """rank and size count the segment's members; names[q] is member q's rank in the whole
        group (what every message and culprit uses: a host's segment may hold some ranks only)."""
        self.rank, self.size, self.chunk_bytes = rank, size, chunk_bytes
        self.pids = pids
        self._describe = describe
        self._mismatch_text = mismatch
        self.names = list(range(size)) if names is None else list(names)
        self._member = {name: q for q, name in enumerate(self.names)}
        total = self.segment_bytes(size, chunk_bytes)
        fd = segment if isinstance(segment, int) else os.open(segment, os.O_RDWR | os.O_CLOEXEC)
        self._pidfds: dict[int, int] = {}
        self._open = True
        try:
            if os.fstat(fd).st_size != total:
                raise OSError(0, f"segment is {os.fstat(fd).st_size} bytes, expected {total}")
            self.mem = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            if not isinstance(segment, int):
                os.close(fd)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        n, r = self.size, self.rank
        self.words = AtomicWords(self.mem)
        self._mask_addr = self.words.address(SLEEPERS)
        self._arrivals_addr = self.words.address(ARRIVALS)
        self._futex = futex.Futex(self.words.integer_address(self._arrivals_addr))
        self._counter_addr = [self.words.address(CONTROL * (q + 1) + COUNTER) for q in range(n)]
        self._broken_addr = [self.words.address(CONTROL * (q + 1) + BROKEN) for q in range(n)]
        # Plain reads of the counters (index of each counter word): a cheap hint while spinning,
        # always confirmed by an atomic load.
        self._counter_word = [(CONTROL * (q + 1) + COUNTER) // 8 for q in range(n)]
        self._ctrl = memoryview(self.mem)
        self._header_at = [[CONTROL * (q + 1) + HEADER + p * HEADER_BYTES for p in range(2)] for q in range(n)]
        base = self._data_offset(n)
        c = self.chunk_bytes
        self.buffers = [[np.ndarray((c,), np.uint8, buffer=self.mem, offset=base + (q * 2 + p) * c)
                         for p in range(2)] for q in range(n)]
        self._typed: dict = {}
        self._stacked: dict = {}
        # Per-message-shape decisions of the algorithms (local/algorithms.py), views included.
        self.plans: dict = {}
        self.step = 0
        self.peers = [q for q in range(n) if q != r]
        self._poll = select.poll()
        for q in self.peers:
            fd = os.pidfd_open(self.pids[q])
            self._pidfds[fd] = q
            self._poll.register(fd, select.POLLIN)
        self._watched: dict[int, tuple[str, int]] = {}
        self.spin_s = 0.0
        self.yield_s = 0.0  # use.attach sets both (from the settings and the host's CPUs)
        self.stall_report_s: float | None = None
        self.deadline = float("inf")
        self.what: object = "collective"

    # ---- set-up by the owner --------------------------------------------------------------

    def watch(self, fd: int, label: str, peer: int = -1) -> None:
        """Also wake up and fail when this socket's peer (rank `peer` of the whole group) hangs
        up (a ring link, a JACCL mesh connection). Only for a segment of the whole group: a rank
        on another host may finish a collective and leave while this host's ranks are still at it."""
        self._watched[fd] = (label, peer)
        self._poll.register(fd, select.POLLRDHUP)

    def stacked(self, parity: int, dtype: np.dtype) -> np.ndarray:
        """Every rank's buffer of this parity as rows of one (size, chunk) array of dtype, so a
        reduction over ranks is a single ufunc call (cached: the small-message hot path)."""
        key = (parity, dtype)
        view = self._stacked.get(key)
        if view is None:
            dtype = np.dtype(dtype)
            rows = self.buffers[1][parity].ctypes.data - self.buffers[0][parity].ctypes.data if self.size > 1 else 0
            view = self._stacked[key] = np.ndarray(
                (self.size, self.chunk_bytes // dtype.itemsize), dtype, buffer=self.mem,
                offset=self._data_offset(self.size) + parity * self.chunk_bytes, strides=(rows, dtype.itemsize))
        return view

    def typed(self, q: int, parity: int, dtype: np.dtype) -> np.ndarray:
        """Rank q's buffer of this parity as an array of dtype (cached: this is the hot path)."""
        key = (q, parity, dtype)
        view = self._typed.get(key)
        if view is None:
            view = self._typed[key] = self.buffers[q][parity].view(dtype)
        return view

    # ---- steps ----------------------------------------------------------------------------

    def exchange(self, header: bytes | None = None) -> int:
        """Publish this rank's buffer of the current step and wait for every peer's. With a header,
        also check that every peer runs the same collective. Returns the parity just exchanged."""
        parity = self.step & 1
        if header is not None:
            # By parity, like the data: a peer may start the next step (and write its next header)
            # before this rank has read this one.
            at = self._header_at[self.rank][parity]
            self._ctrl[at:at + HEADER_BYTES] = header
        self.step += 1
        step = self.step
        words = self.words
        words.store(self._counter_addr[self.rank], step, SEQ_CST)
        # The addition that brings the arrival word to a multiple of the size completes a step
        # (not necessarily this one: a rank already past it may add first): its rank wakes the
        # sleepers, and nobody else makes a system call.
        if (words.fetch_add(self._arrivals_addr, 1, SEQ_CST) + 1) % self.size == 0 \
                and words.load(self._mask_addr, SEQ_CST) & ~(1 << self.rank):
            self._futex.wake()
        plain, index = words.plain, self._counter_word
        try:
            for q in self.peers:
                if plain[index[q]] < step or words.load(self._counter_addr[q], ACQUIRE) < step:
                    self._wait(q, step)
        except PeerError:
            # A peer that left after seeing a mismatch: say the mismatch too, when a peer that
            # published this step called something else (not only that the group broke).
            if header is not None:
                self._check_headers(header, parity, [q for q in self.peers
                                                     if words.load(self._counter_addr[q], ACQUIRE) >= step])
            raise
        if header is not None:
            self._check_headers(header, parity, self.peers)
        return parity

    def _check_headers(self, header: bytes, parity: int, peers: list[int]) -> None:
        for q in peers:
            at = self._header_at[q][parity]
            if self._ctrl[at:at + HEADER_BYTES] != header:
                raise MismatchError(self._mismatch(header, bytes(self._ctrl[at:at + HEADER_BYTES]), q))

    def _mismatch(self, mine: bytes, theirs: bytes, q: int) -> str:
        me, peer = self.names[self.rank], self.names[q]
        if self._mismatch_text is not None:
            return self._mismatch_text(me, peer, mine, theirs)
        return (f"rank {me}: collective mismatch with rank {peer}: this rank called "
                f"{self._describe(mine)} but rank {peer} called {self._describe(theirs)}")

    def _value(self, q: int, step: int) -> int | None:
        v = self.words.load(self._counter_addr[q], ACQUIRE)
        if v >= step:
            return v
        # A separate word, not the counter: a peer that published this step and then found a
        # mismatch must still let this rank read its header (and raise the same MismatchError).
        broken = self.words.load(self._broken_addr[q], ACQUIRE)
        if broken:
            raise self._peer_error(*self._left(q, broken))
        return None

    def _left(self, q: int, broken: int) -> tuple[str, int]:
        """What to say about peer q, which left after an error, and whom to blame (a rank of the
        whole group): the rank q blamed when it named one (a relayed death), else q itself."""
        culprit, name = broken - BROKEN_BASE, self.names[q]
        if 0 <= culprit != name and culprit != self.names[self.rank]:
            return (f"rank {culprit} died or failed (reported by rank {name} (pid {self.pids[q]}), which left "
                    f"the group after that) (shared memory)"), culprit
        if culprit == self.names[self.rank]:
            # q gave up waiting for this (stopped, resumed) rank: naming live q would get it excluded
            return (f"rank {name} (pid {self.pids[q]}) gave up waiting for this rank: this process was stopped or "
                    f"too slow, and the others may have carried on without it (shared memory)"), -1
        return f"rank {name} (pid {self.pids[q]}) left the group after an error (shared memory)", name

    def _peer_error(self, text: str, culprit: int) -> PeerError:
        exc = PeerError(f"rank {self.names[self.rank]}: {self.what}: {text}")
        exc.culprit = culprit  # the backend passes it on (mark_broken) so every survivor names the same rank
        return exc

    def _wait(self, q: int, step: int) -> None:
        plain, index = self.words.plain, self._counter_word[q]
        # Busy-spin (the peer is running elsewhere and about to publish), then spin giving the
        # CPU away (the peer may be waiting for this very CPU), then sleep until the step
        # completes, a peer leaves or dies, or the deadline.
        now = time.monotonic()
        spin_until = now + self.spin_s
        yield_until = spin_until + self.yield_s
        while now < yield_until:
            if plain[index] >= step and self._value(q, step) is not None:
                return
            if now >= spin_until:
                os.sched_yield()
            now = time.monotonic()
        self._sleep(q, step)

    def _sleep(self, q: int, step: int) -> None:
        bit = 1 << self.rank
        words = self.words
        words.fetch_or(self._mask_addr, bit)
        now = time.monotonic()
        stall_at = now + self.stall_report_s if self.stall_report_s else None
        every = LIVENESS_FIRST_S
        check_at = now + every
        try:
            while True:
                arrivals = words.load(self._arrivals_addr, SEQ_CST)  # before the counter: see the module doc
                v = words.load(self._counter_addr[q], SEQ_CST)
                if v >= step or self._value(q, step) is not None:  # _value raises if q left
                    return
                for other in self.peers:  # any rank that gave up dooms this collective too
                    if other != q and words.load(self._broken_addr[other], ACQUIRE):
                        self._value(other, BEYOND)
                now = time.monotonic()
                if now >= check_at:
                    self._check_alive(q, step)
                    every = min(every * 2, LIVENESS_MAX_S)
                    check_at = now + every
                if now >= self.deadline:
                    late = CollectiveTimeout(
                        f"rank {self.names[self.rank]}: {self.what} timed out: rank {self.names[q]} "
                        f"(pid {self.pids[q]}) is alive "
                        f"but has not reached step {step} (it is at {v}) of this collective (shared memory)")
                    # The rank waited for is to blame, not this one: passed on by mark_broken, so
                    # the peers this rank's exit fails name the stalled rank too, never this live one.
                    late.culprit = self.names[q]
                    raise late
                wait = min(self.deadline, check_at) - now
                if stall_at is not None:
                    if now >= stall_at:
                        log.warning("rank %d: %s is stalled: waiting for rank %d (pid %d) over shared memory",
                                    self.names[self.rank], self.what, self.names[q], self.pids[q])
                        stall_at = None
                    else:
                        wait = min(wait, stall_at - now)
                if words.load(self._broken_addr[self.rank], ACQUIRE):  # another thread gave the group up
                    raise PeerError(f"rank {self.names[self.rank]}: {self.what}: this rank gave the group up "
                                    f"while this collective waited (shared memory)")
                self._futex.wait(arrivals, wait)
        finally:
            words.fetch_and(self._mask_addr, ~bit & MASK64)

    def _check_alive(self, q: int, step: int) -> None:
        """Raise when a peer exited or a watched socket's peer hung up (a look, never a wait)."""
        for fd, _ in self._poll.poll(0):
            gone = self._event(fd)
            # A peer that exited after finishing its part is no error: re-check first.
            if gone is not None and self._value(q, step) is None:
                raise self._peer_error(*gone)

    def _event(self, fd: int) -> tuple[str, int] | None:
        """What a poll event on a pidfd or a watched socket means, and the rank to blame."""
        q = self._pidfds.get(fd)
        label, peer = self._watched.get(fd, (f"fd {fd}", -1)) if q is None else ("", self.names[q])
        # A peer that raised marked its word before it closed its links (or exited): name
        # the rank it blamed rather than the peer that passed the failure on.
        member = self._member.get(peer)
        broken = self.words.load(self._broken_addr[member], ACQUIRE) if member is not None else 0
        if broken:
            return self._left(member, broken)
        if q is not None:
            return (f"rank {self.names[q]} (pid {self.pids[q]}) exited while this rank waited for it "
                    f"(shared memory)"), self.names[q]
        return f"{label} closed its connection (the peer died or raised)", peer

    def mark_broken(self, culprit: int = -1) -> None:
        """Tell every peer (waiting or not) that this rank left the group after an error, and
        which rank of the whole group it blames (-1: its own error)."""
        if not self._open:
            return
        try:
            self.words.store(self._broken_addr[self.rank], BROKEN_BASE + max(culprit, -1), SEQ_CST)
            # Move the arrival word (by a multiple of the size, which keeps the completion rule):
            # a peer about to sleep on it then returns at once instead of sleeping through this.
            self.words.fetch_add(self._arrivals_addr, self.size, SEQ_CST)
        except Exception:
            return
        self._futex.wake()

    def close(self) -> None:
        for fd in self._pidfds:
            os.close(fd)
        self._pidfds = {}
        self._open = False
        words = getattr(self, "words", None)
        if words is not None:
            words.release()
        self._typed = {}
        self._stacked = {}
        self.plans = {}
        self.buffers = []
        ctrl = getattr(self, "_ctrl", None)
        if ctrl is not None:
            ctrl.release()
        try:
            self.mem.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when it does
