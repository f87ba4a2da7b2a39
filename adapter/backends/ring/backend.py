"""The ring backend: collectives over TCP connections between ring neighbours.

Environment (same as MLX): MLX_RANK, and MLX_HOSTFILE, a JSON list with, for each rank,
the "ip:port" addresses it listens on. Rank r connects to every address of rank r+1 (one
connection each) and accepts the same number from rank r-1.

Large reductions run reduce-scatter then all-gather with the buffer split across every
connection and both directions of the ring, segments pipelined (see algorithms.py).
Small messages take a one-pass path: a ring all-gather of the whole inputs followed by a
reduction in rank order, which costs one hop per rank instead of two phases.

send/recv reach ANY rank: a direct connection to the peer's first address is opened on
first use (beyond MLX, whose ring only talks to neighbours).

Every collective starts with a 24-byte header (operation, dtype, byte count, sequence
number) exchanged with the neighbours, so a mismatch between ranks raises MismatchError
on both sides instead of corrupting data or hanging.
"""
from __future__ import annotations

import json
import logging
import os
import select
import socket
import threading
import time
from collections import deque

import numpy as np

from ... import config, logs
from ...config import connect_timeout as default_connect_timeout
from ...config import env_rank, op_timeout
from ...errors import (
    CollectiveTimeout,
    ConfigError,
    DistributedError,
    IntegrityError,
    MismatchError,
    PeerError,
    blaming,
)
from ..base import Backend, ReduceOp, split_members
from ..elements import DTYPE_CODES, byte_view, dtype_code, reduce_many, split_evenly
from ..local import algorithms as shm_algorithms
from ..protocol import REDUCE_CODES, mismatch_message
from ..transport import auth, integrity, tcp
from ..transport.names import check_resolvable
from ..transport.stream_engine import Engine, Stream
from . import hierarchy, origin, shared
from .algorithms import Channel, chain_broadcast, reduce_scatter_all_gather
from .algorithms import all_gather as ring_all_gather
from .formation import FormationAbandoned, Watch
from .header import (
    ABORT_DIED,
    ABORT_MISSING,
    HEADER,
    HEADER_MAGIC,
    OP_ABORT,
    OP_ALL_GATHER,
    OP_ALL_REDUCE,
    OP_BARRIER,
    OP_BROADCAST,
    OP_REDUCE_SCATTER,
    OP_SEND,
    OP_SHM,
    OP_SPLIT,
    describe_header,
    find_abort,
    header_request,
)

log = logging.getLogger("jacklring.ring")

PURPOSE_RING = 1
PURPOSE_P2P = 2
VERDICT_GRACE_S = 0.45  # the closing barrier of init() waits this long past the connect deadline
                        # for a neighbour's verdict on a missing rank (within the deadline's 0.5 s)
PURPOSE_ABORT = 3  # a rank that gave up forming tells a ring neighbour it had no connection with yet

ABORT_NOTICE_S = 1.0  # how long a rank that gave up tries to reach a neighbour it had no connection with
SPILL_CHUNK = 1 << 20   # bytes read ahead at a time from a peer while a send to it is blocked
SPILL_POLL_S = 0.05     # how long a blocked send waits before looking for the peer's connection again


def probe() -> str | None:
    missing = [name for name in ("MLX_RANK", "MLX_HOSTFILE") if not os.environ.get(name)]
    if missing:
        return f"{' and '.join(missing)} not set"
    return None


_incarnations = 0  # rings this process formed from the environment (see RingBackend's token)


def create(timeout: float | None = None) -> "RingBackend":
    global _incarnations
    path = os.environ["MLX_HOSTFILE"]
    addresses = load_ring_hostfile(path)
    rank = env_rank(len(addresses), f"MLX_HOSTFILE {path!r}")
    _incarnations += 1
    return RingBackend.from_addresses(rank, addresses, timeout=timeout, incarnation=_incarnations)


def load_ring_hostfile(path: str) -> list[list[str]]:
    """Read and validate MLX_HOSTFILE: a JSON list, per rank, of "ip:port" strings."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ConfigError(f"MLX_HOSTFILE {path!r} cannot be read: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:  # bad JSON, undecodable bytes, absurd nesting
        raise ConfigError(f"MLX_HOSTFILE {path!r} is not valid JSON: {exc}") from None
    return validate_addresses(data, f"MLX_HOSTFILE {path!r}")


def validate_addresses(data: object, where: str) -> list[list[str]]:
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{where} must be a non-empty JSON list with one list of 'ip:port' per rank")
    for rank, entry in enumerate(data):
        if isinstance(entry, str):
            entry = data[rank] = [entry]
        if not isinstance(entry, list) or not entry:
            raise ConfigError(f"{where}: entry {rank} must be a non-empty list of 'ip:port' strings, got {entry!r}")
        for addr in entry:
            tcp.parse_address(addr, f"{where}: rank {rank} address")
    _reject_duplicates(data, where)
    for rank, entry in enumerate(data):
        for addr in entry:
            check_resolvable(tcp.parse_address(addr)[0], f"{where}: rank {rank} address {addr!r}")
    return data


def _reject_duplicates(data: list[list[str]], where: str) -> None:
    """Two listeners on one ip:port cannot both exist: fail on every rank at once instead of
    one rank failing to listen while its neighbour waits out the connect deadline.
    Port 0 (any free port) may repeat."""
    owner: dict[tuple[str, int], int] = {}
    for rank, entry in enumerate(data):
        for addr in entry:
            host, port = tcp.parse_address(addr)
            if port == 0:
                continue
            first = owner.setdefault((host, port), rank)
            if first != rank or _listed_twice(entry, (host, port)):
                raise ConfigError(f"{where}: rank {first} and rank {rank} both listen on "
                                  f"{tcp.format_address((host, port))}; every address must be distinct")


def _listed_twice(entry: list[str], key: tuple[str, int]) -> bool:
    return sum(tcp.parse_address(a) == key for a in entry) > 1


class _Described:
    """Formats a header only when an error message needs it (off the hot path)."""

    __slots__ = ("header",)

    def __init__(self, header: bytes) -> None:
        self.header = header

    def __str__(self) -> str:
        return describe_header(self.header)


def _copy(src: np.ndarray, dst: np.ndarray) -> None:
    if dst is not src:
        dst[...] = src


class SplitAbandoned(FormationAbandoned):
    """A sub-group stopped forming because `culprit` (a parent rank, or -1) died or gave up."""


class RingBackend(Backend):
    name = "ring"

    @classmethod
    def from_addresses(cls, rank: int, addresses: list[list[str]], timeout: float | None = None,
                       connect_timeout: float | None = None, incarnation: int = 0,
                       job: auth.Auth | None = None) -> "RingBackend":
        """Listen on this rank's addresses and connect the ring (the constructor a store-based
        rendezvous, such as torch's, uses)."""
        addresses = validate_addresses([list(a) if not isinstance(a, str) else [a] for a in addresses], "addresses")
        if not 0 <= rank < len(addresses):
            raise ConfigError(f"rank {rank} is out of range for {len(addresses)} ranks")
        listeners = []
        try:
            if len(addresses) > 1:
                for addr in addresses[rank]:
                    host, port = tcp.parse_address(addr)
                    listeners.append(tcp.Listener(host, port))
        except PeerError as exc:
            for sock in listeners:
                sock.close()
            raise PeerError(f"rank {rank}: {exc}") from None
        return cls(rank, addresses, listeners, timeout, connect_timeout, incarnation, job)

    def __init__(self, rank: int, addresses: list[list[str]], listeners: list[tcp.Listener],
                 timeout: float | None, connect_timeout: float | None, incarnation: int = 0,
                 job: auth.Auth | None = None, watch: Watch | None = None,
                 parent_ranks: list[int] | None = None) -> None:
        self._rank = rank
        # A split's watch names members by their parent rank (parent_ranks[sub-group rank]).
        self._watched_rank = (lambda p: p) if parent_ranks is None else parent_ranks.__getitem__
        self._describe_member = lambda p: f"rank {p}"  # a split names ranks in both numberings
        # What an abort header is about (a split's parent rewords these for the sub-groups).
        self._task, self._forming, self._member_word = "forming the group", "the group", "rank"
        self._abandoned: type[FormationAbandoned] = FormationAbandoned
        # While a split forms this sub-ring, an abort header read here names parent ranks: word
        # it as the parent's watch does (None once formed, or for a ring of its own).
        self._formation_text = watch.explain if watch is not None else None
        # A split passes the watch over its parent's links; init watches this ring's own.
        self._formation = watch if watch is not None else Watch(
            find_abort, self._abort_header, self._abort_text, self._describe_member, self._forming,
            prefix=f"rank {rank}: ")
        self._own_formation = watch is None
        self._gave_up = False
        self._abandon_on_failure = False
        self._size = len(addresses)
        self._addresses = addresses
        self._listeners = listeners
        self.timeout = op_timeout(timeout)
        self._connect_timeout = default_connect_timeout(connect_timeout)
        # The job context is the address list and the incarnation (how many rings this process
        # formed from the same hostfile: a re-formed ring's connections never count in a listener
        # of the ring closed before it). The key is the job secret (or, without one, derived from
        # that public context: see transport/auth.py).
        context = json.dumps([addresses, incarnation]).encode()
        self._token = auth.context_id(context)
        # The secret's stretch is salted by the addresses alone: it runs once for every incarnation.
        self._auth = job if job is not None else auth.job_auth(context, "the ring",
                                                               salt=json.dumps(addresses).encode())
        self._seq = 0
        self._verify = config.get("JACKLRING_VERIFY")
        self._integrity: dict[tuple[int, int], integrity.Integrity | None] = {}
        self._small_limit = config.get("JACKLRING_RING_SMALL_BYTES")
        self._one_pass_limit = config.get("JACKLRING_RING_ONE_PASS_BYTES")
        if self._one_pass_limit is None:
            # Unset: 32 KiB between hosts. With every rank on this host (the same answer on every
            # rank), bytes are memory copies and hops cost scheduler rounds, so the one-pass path
            # (half the hops) wins up to the small limit.
            local = tcp.local_rank_count([a[0] for a in addresses], addresses[rank][0]) == len(addresses)
            self._one_pass_limit = self._small_limit * len(addresses) if local else 32 * 1024
        self._segment_bytes = config.get("JACKLRING_RING_SEGMENT_BYTES")
        self._both_directions = config.get("JACKLRING_RING_DIRECTIONS") == 2
        self._pool: dict[tuple, np.ndarray] = {}
        self._small_view: memoryview | None = None
        self._p2p_out: dict[int, socket.socket] = {}
        self._p2p_in: dict[int, socket.socket] = {}
        self._p2p_unusable: dict[int, str] = {}  # peer -> why its incoming stream was given up
        # Bytes read ahead from a peer's stream while a send to it was blocked (see _send_bytes),
        # consumed by recv() before the socket; at most JACKLRING_P2P_SPILL_BYTES per peer.
        self._spill: dict[int, deque[memoryview]] = {q: deque() for q in range(self._size)}
        self._spilled = dict.fromkeys(range(self._size), 0)
        self._spill_ended: set[int] = set()
        self._spill_limit = config.get("JACKLRING_P2P_SPILL_BYTES")
        self._p2p_lock = threading.Lock()
        # One message at a time per peer and direction: two threads writing (or reading) one
        # connection at once would interleave their bytes.
        self._send_locks = {q: threading.Lock() for q in range(self._size)}
        self._recv_locks = {q: threading.Lock() for q in range(self._size)}
        self._lock = threading.Lock()  # one collective at a time on the ring links
        self.right: list[Stream] = []
        self.left: list[Stream] = []
        self.engine: Engine | None = None
        self._shm = None  # a local.shm.SharedGroup when the whole group is on this host
        self._hier: hierarchy.Hierarchy | None = None  # when it spans hosts, some with several ranks
        self._stage = 0  # on a leaders' ring: the tag of the group's collective (hierarchy.py)
        logs.apply_verbose_setting()  # MLX_RING_VERBOSE: jacklring's own handler, never the root logger's
        if self._size > 1:
            k = min(len(a) for a in addresses)
            try:
                for c, listener in enumerate(listeners):
                    listener.serve(self._auth, self._token, rank, lambda h, c=c, k=k: self._admit(h, c, k),
                                   f"rank {rank}")
                self._connect_ring()
                if watch is None:
                    self._finish_formation()  # a split's parent runs the closing barrier instead
                self._attach_shared_memory()
            except BaseException as exc:
                self._give_up_forming(exc, tell_unlinked=watch is None)
                self.close()  # the listeners, so a failed formation leaves no fd behind
                if watch is None and isinstance(exc, FormationAbandoned):
                    raise blaming(PeerError(str(exc)), exc.culprit) from None
                raise blaming(exc, getattr(exc, "missing_rank", None))

    # ---- set-up ---------------------------------------------------------------------------

    def _who(self, rank: int, index: int = 0) -> str:
        return f"rank {rank} ({self._addresses[rank][index]})"

    def _admit(self, hello: tcp.Hello, listener: int, k: int) -> str | None:
        """Who may connect to this rank's listener number `listener`: the left neighbour's ring
        connection of that number, and (on the first) any other rank's point-to-point stream."""
        prv = (self._rank - 1) % self._size
        if hello.purpose == PURPOSE_RING:
            if hello.sender == prv and hello.channel == listener < k:
                return None
            return f"ring connection {listener} is for rank {prv}"
        if hello.purpose == origin.PURPOSE_NOTICE and listener == 0:
            return None if origin.admits(hello.sender, self._rank, self._size) else f"no rank {hello.sender} here"
        if hello.purpose == PURPOSE_P2P and listener == 0:
            if 0 <= hello.sender < self._size and hello.sender != self._rank and hello.channel == 0:
                return None
            return f"no rank {hello.sender} sends point-to-point here"
        if hello.purpose == PURPOSE_ABORT and listener == 0:
            if hello.sender in (prv, (self._rank + 1) % self._size) and hello.channel == 0:
                return None
            return f"rank {hello.sender} is not a ring neighbour"
        return f"unknown purpose {hello.purpose:#x}"

    def _connect_ring(self) -> None:
        n, r = self._size, self._rank
        nxt, prv = (r + 1) % n, (r - 1) % n
        # Every rank must use the same number of connections per neighbour pair.
        k = min(len(a) for a in self._addresses)
        deadline = self._formation_deadline = time.monotonic() + self._connect_timeout
        watch = self._formation
        as_watched = self._watched_rank
        right: list = []
        left_socks: list[socket.socket | None] = [None] * k
        left_hellos: list = [None] * k  # their handshakes: the nonces key each connection's trailers
        aborts: list[socket.socket] = []

        def arrivals() -> None:
            """Take the left neighbour's connections (and abort notices) as they arrive, so they
            are watched while this rank still connects to the right."""
            now = time.monotonic()
            for c in range(k):
                if left_socks[c] is None:
                    taken = self._listeners[c].take(lambda h: h.purpose == PURPOSE_RING, now, None)
                    if taken is not None:
                        left_socks[c], left_hellos[c] = taken
                        watch.add(taken[0], as_watched(prv))
            while (taken := self._listeners[0].take(lambda h: h.purpose == PURPOSE_ABORT, now, None)) is not None:
                aborts.append(taken[0])
                watch.add(taken[0], taken[1].sender)

        watch.wake_on(self._listeners, arrivals,
                      lambda p: (p == as_watched(nxt) and len(right) < k) or (p == as_watched(prv) and None in left_socks))
        try:
            for c in range(k):
                sock, hello = self._connect_right(nxt, c, deadline)
                watch.add(sock, as_watched(nxt))
                right.append(Stream(sock, nxt, self._who(nxt, c), integrity.for_link(
                    self._verify, self._auth, self._token, r, nxt, f"ring {r}->{nxt} #{c}", hello.session)))
            watch.wait(deadline, lambda: None not in left_socks)
            for c in range(k):
                if left_socks[c] is None:  # the deadline: the listener's error names what is missing
                    try:
                        left_socks[c], left_hellos[c] = self._listeners[c].take(
                            lambda h: h.purpose == PURPOSE_RING, deadline, f"rank {r}: rank {prv} (connection {c} of {k})")
                    except PeerError as exc:
                        exc.missing_rank, exc.about_rank = as_watched(prv), prv  # type: ignore[attr-defined]
                        raise
            left = [Stream(sock, prv, self._who(prv, c), integrity.for_link(
                self._verify, self._auth, self._token, r, prv, f"ring {prv}->{r} #{c}", left_hellos[c].session))
                for c, sock in enumerate(left_socks)]
        except BaseException as exc:
            self._give_up_forming(exc, tell_unlinked=self._own_formation)  # before the connections close
            for item in right:
                item.close()
            for sock in left_socks:
                if sock is not None:
                    sock.close()
            raise
        finally:
            watch.wake_on([], None)
            for sock in aborts:
                sock.close()
        self.right, self.left = right, left  # type: ignore[assignment]
        self.engine = Engine(right + left, r)  # type: ignore[operator]
        self.engine.stall_report_s = config.get("JACKLRING_STALL_REPORT")
        self.engine.spin_s = tcp.spin_seconds(
            tcp.local_rank_count([a[0] for a in self._addresses], self._addresses[r][0]))
        log.debug("rank %d: ring connected (%d connection(s) to rank %d and from rank %d)", r, k, nxt, prv)

    def _connect_right(self, nxt: int, c: int, deadline: float) -> tuple[socket.socket, tcp.Hello]:
        """Connect ring connection c to the right neighbour; the handshake's acknowledgement
        means the neighbour took it. Between attempts the formation's watch sleeps in poll() on the
        connections that can bring news of a death (see formation.py)."""
        addr = tcp.parse_address(self._addresses[nxt][c])
        hello = tcp.Hello(PURPOSE_RING, self._rank, nxt, c, self._token)
        self._formation.check()
        try:
            return tcp.connect_with_hello(addr, hello, deadline, f"rank {nxt}", self._auth,
                                          pause=self._formation.pause)
        except FormationAbandoned:
            raise
        except PeerError as exc:
            error = PeerError(f"rank {self._rank}: {exc}")
            error.about_rank = nxt  # type: ignore[attr-defined]
            if time.monotonic() >= deadline:
                error.missing_rank = self._watched_rank(nxt)  # type: ignore[attr-defined]
            raise error from None

    def _abort_header(self, culprit: int, missing: bool = False) -> bytes:
        return HEADER.pack(HEADER_MAGIC, OP_ABORT, ABORT_MISSING if missing else ABORT_DIED, self._rank, 0, culprit)

    def _finish_formation(self) -> None:
        """A closing barrier: no rank leaves init() before every rank has connected, and a rank
        whose barrier fails passes the verdict on over the ring (see _collective)."""
        self._abandon_on_failure = True
        # A little past the connect deadline: a neighbour's verdict on a missing rank (sent at
        # that deadline) arrives first, so this rank names it instead of the neighbour.
        op_timeout, self.timeout = self.timeout, max(0.001, self._formation_deadline - time.monotonic()) + VERDICT_GRACE_S
        seq = self._seq
        try:
            self.barrier()  # waits for the slowest rank's formation: the connect deadline bounds it
            self._seq = seq  # formation traffic: the caller's operations keep their numbers (seq 1 first)
        except FormationAbandoned:
            raise
        except DistributedError as exc:
            peer = getattr(exc, "peer", -1)
            waited = getattr(exc, "waiting_on", None)  # past the grace: that rank said nothing at all
            if peer < 0 and waited:
                raise FormationAbandoned(waited[0], f"rank {self._rank}: {self._describe_member(waited[0])} went "
                                                    f"silent while the group formed (the closing barrier "
                                                    f"failed: {exc})") from None
            if peer < 0:
                raise
            raise FormationAbandoned(peer, f"rank {self._rank}: {self._describe_member(peer)} died while the "
                                           f"group formed (the closing barrier failed: {exc})") from None
        finally:
            self._abandon_on_failure = False
            self.timeout = op_timeout

    def _give_up_forming(self, exc: BaseException, tell_unlinked: bool) -> None:
        """A formation failed here: pass the verdict on before the connections close (so the
        others read an abort naming the culprit, not just a closed connection). Once."""
        if self._gave_up:
            return
        self._gave_up = True
        culprit = exc.culprit if isinstance(exc, FormationAbandoned) else getattr(exc, "missing_rank", -1)
        missing = exc.missing if isinstance(exc, FormationAbandoned) else culprit >= 0
        if culprit < 0:
            try:
                self._formation.check()  # a failure here is often the echo of a death elsewhere
            except FormationAbandoned as cause:
                culprit, missing = cause.culprit, cause.missing
        self._formation.abandon(culprit, missing)
        if not tell_unlinked or self._size < 2:
            return
        # A ring neighbour this rank has no connection with yet would wait for its deadline (not
        # the one this failure is about: it is missing, or something else answers at its address).
        until = time.monotonic() + ABORT_NOTICE_S
        skip = {culprit, self._rank, getattr(exc, "about_rank", -1)}
        for peer in {(self._rank + 1) % self._size, (self._rank - 1) % self._size} - skip:
            if self._formation.linked(peer):
                continue
            hello = tcp.Hello(PURPOSE_ABORT, self._rank, peer, 0, self._token)
            try:
                sock = tcp.connect(tcp.parse_address(self._addresses[peer][0]), hello, until,
                                   f"rank {peer}", self._auth)
            except DistributedError:
                continue  # not listening (yet): it waits for its own deadline
            try:
                sock.sendall(self._abort_header(culprit, missing))
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            finally:
                sock.close()

    # ---- Backend interface ----------------------------------------------------------------

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def all_reduce(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        if self._size == 1:
            return _copy(src, dst)
        header = self._header(OP_ALL_REDUCE, src, REDUCE_CODES[op])
        if self._shm is not None and src.nbytes <= self._shm_one_step and not self._abandon_on_failure:
            # The small-message hot path: what _shared does, one call shorter.
            self._collective(header, shared.run, self, shm_algorithms.small_all_reduce, header, src, dst, op)
            return
        if self._shared(header, shm_algorithms.all_reduce, src, dst, op, self._shm_small):
            return
        if self._staged(header, hierarchy.all_reduce, src, dst, op, self._shm_small):
            return
        n = self._size
        if self._one_pass(src.nbytes):
            self._collective(header, lambda: self._small_all_reduce(header, src, dst, op))
            return
        blocks = split_evenly(src.size, n)
        self._collective(header, lambda: self._large(header, src, dst, blocks, op, gather=True))

    def reduce_scatter(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        if self._size == 1:
            return _copy(src, dst)
        header = self._header(OP_REDUCE_SCATTER, src, REDUCE_CODES[op])
        if self._shared(header, shm_algorithms.reduce_scatter, src, dst, op):
            return
        if self._staged(header, hierarchy.reduce_scatter, src, dst, op, self._shm_small):
            return
        n = self._size
        if self._one_pass(src.nbytes):
            def run() -> None:
                full = self._buffer("rs-small", src.dtype, src.size)
                self._small_all_reduce(header, src, full, op)
                dst[...] = full[self._rank * dst.size:(self._rank + 1) * dst.size]
            self._collective(header, run)
            return
        blocks = [(i * dst.size, (i + 1) * dst.size) for i in range(n)]
        self._collective(header, lambda: self._large(header, src, dst, blocks, op, gather=False))

    def set_timeout(self, seconds: float) -> None:
        self.timeout = config.check_seconds(float(seconds), "timeout")

    def all_gather(self, src: np.ndarray, dst: np.ndarray) -> None:
        if self._size == 1:
            return _copy(src, dst)
        header = self._header(OP_ALL_GATHER, src, 0)
        if self._shared(header, shm_algorithms.all_gather, src, dst):
            return
        if self._staged(header, hierarchy.all_gather, src, dst):
            return
        if src.nbytes <= self._small_limit:
            def run() -> None:
                parts = self._small_gather(header, byte_view(src))
                for q, part in enumerate(parts):
                    dst[q * src.size:(q + 1) * src.size] = np.frombuffer(part, src.dtype)
            self._collective(header, run)
            return
        self._collective(header, lambda: self._large_gather(header, src, dst))

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if not 0 <= root < self._size:
            raise ValueError(f"broadcast root {root} is out of range for {self._size} ranks")
        if self._size == 1:
            return
        header = self._header(OP_BROADCAST, buf, root)
        if self._shared(header, shm_algorithms.broadcast, buf, root):
            return
        if self._staged(header, hierarchy.broadcast, buf, root):
            return
        self._collective(header, lambda: self._broadcast(header, buf, root))

    def barrier(self) -> None:
        if self._size == 1:
            return
        header = HEADER.pack(HEADER_MAGIC, OP_BARRIER, 0, self._seq, 0, 0)
        if self._shared(header, shm_algorithms.barrier):
            return
        if self._staged(header, hierarchy.barrier):
            return
        self._collective(header, lambda: self._small_gather(header, memoryview(b"")))

    def send(self, buf: np.ndarray, dst: int) -> None:
        with self._send_locks[dst]:
            try:
                self._send(buf, dst)
            except (PeerError, CollectiveTimeout) as exc:
                named = origin.blame_p2p(self, exc, dst)  # the rank at fault, and tell the others
                if named is exc:
                    raise
                raise named from None

    def _send(self, buf: np.ndarray, dst: int) -> None:
        self.failure.check()
        deadline = time.monotonic() + self.timeout
        header = HEADER.pack(HEADER_MAGIC, OP_SEND, dtype_code(buf.dtype), 0, buf.nbytes, 0)
        sock = self._p2p_out_socket(dst, deadline)
        who = f"rank {self._rank}: send to {self._who(dst)}"
        seal = self._p2p_integrity("p2p", self._rank, dst)
        trailer = seal.seal(byte_view(buf)) if seal is not None else b""
        if buf.nbytes <= self._small_limit:
            self._send_bytes(sock, memoryview(header + byte_view(buf).tobytes() + trailer), dst, who)
        else:
            self._send_bytes(sock, memoryview(header), dst, who)
            self._send_bytes(sock, byte_view(buf), dst, who)
            self._send_bytes(sock, memoryview(trailer), dst, who)

    def _send_bytes(self, sock: socket.socket, data: memoryview, dst: int, who: str) -> None:
        """Send all of data. While dst takes nothing, read what dst sends to this rank into its
        spill buffer (dst may itself be blocked sending to us: both ranks sending large messages
        before receiving must not deadlock). Fails when nothing moved either way for the timeout."""
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        sock.settimeout(0.0)  # non-blocking: a blocked send reads the peer's stream meanwhile
        silence = self.timeout
        last_move = time.monotonic()
        poller: select.poll | None = None
        while len(view):
            try:
                view = view[sock.send(view):]
                continue
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                raise PeerError(f"{who} failed: {exc.strerror or exc}") from None
            if self._spill_from(dst):
                last_move = time.monotonic()
                continue
            now = time.monotonic()
            if now - last_move >= silence:
                raise CollectiveTimeout(f"{who} timed out: it took no byte for {silence:g} s "
                                        f"({len(view)} bytes left; it is not reading)"
                                        + self._spill_note(dst))
            if poller is None:
                poller = select.poll()
                poller.register(sock, select.POLLOUT)
            incoming = self._spill_socket(dst)
            if incoming is not None:
                try:
                    poller.register(incoming, select.POLLIN)
                except (ValueError, OSError):
                    incoming = None
            poller.poll(max(1, int(min(SPILL_POLL_S, silence - (now - last_move)) * 1000)))
            if incoming is not None:
                try:
                    poller.unregister(incoming)
                except (KeyError, ValueError, OSError):
                    pass

    def _spill_socket(self, peer: int) -> socket.socket | None:
        """peer's incoming point-to-point connection, accepting it when it waits in the listener;
        None when it is not there yet, at end of stream, or the spill buffer is full."""
        if self._spilled[peer] >= self._spill_limit or peer in self._spill_ended:
            return None
        with self._p2p_lock:
            sock = self._p2p_in.get(peer)
        if sock is None and self._listeners:
            # Already authenticated by the listener's acceptor: take it if it is waiting there.
            taken = self._listeners[0].take(lambda h: h.purpose == PURPOSE_P2P and h.sender == peer,
                                            time.monotonic(), None)
            if taken is not None:
                with self._p2p_lock:
                    sock = self._p2p_in.setdefault(peer, taken[0])
                if sock is not taken[0]:
                    taken[0].close()
                else:
                    self._p2p_connected(peer, self._rank, taken[1])
        return sock

    def _spill_from(self, peer: int) -> bool:
        """Read what peer already sent into its spill buffer; True when bytes were read. Only under
        peer's receive lock (a recv() running in another thread owns the stream meanwhile), and the
        chunk is queued before the lock is released, so the stream's order is kept."""
        sock = self._spill_socket(peer)
        if sock is None:
            return False
        lock = self._recv_locks[peer]
        if not lock.acquire(blocking=False):
            return False
        try:
            room = self._spill_limit - self._spilled[peer]
            chunk = bytearray(min(SPILL_CHUNK, room))
            try:
                # Non-blocking: a socket with a timeout would wait for data despite MSG_DONTWAIT
                # (recv() sets its own timeout again).
                sock.settimeout(0.0)
                n = sock.recv_into(chunk, len(chunk))
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                n = 0  # an error, like the end of the stream, is for the next recv() to report
            if n == 0:
                self._spill_ended.add(peer)
                return False
            self._spill[peer].append(memoryview(chunk)[:n])
            self._spilled[peer] += n
            return True
        finally:
            lock.release()

    def _spill_note(self, peer: int) -> str:
        if self._spilled[peer] >= self._spill_limit:
            return (f"; {self._spilled[peer]} bytes from rank {peer} wait in this rank's spill buffer, which is "
                    f"full (JACKLRING_P2P_SPILL_BYTES={self._spill_limit})")
        return ""

    def recv(self, buf: np.ndarray, src: int) -> None:
        with self._recv_locks[src]:
            try:
                self._recv(buf, src)
            except (PeerError, CollectiveTimeout) as exc:
                named = origin.blame_p2p(self, exc, src)
                if named is exc:
                    raise
                raise named from None

    def _recv(self, buf: np.ndarray, src: int) -> None:
        self.failure.check()
        # Checks that need no bytes come first, so a refused recv leaves the stream untouched.
        mine = HEADER.pack(HEADER_MAGIC, OP_SEND, dtype_code(buf.dtype), 0, buf.nbytes, 0)
        unusable = self._p2p_unusable.get(src)
        if unusable is not None:
            raise DistributedError(f"rank {self._rank}: recv from rank {src}: the stream from rank {src} is "
                                   f"unusable after an earlier error ({unusable})")
        deadline = time.monotonic() + self.timeout
        sock = self._p2p_in_socket(src, deadline)
        who = f"rank {self._rank}: recv from {self._who(src)}"
        raw = bytearray(HEADER.size)
        self._recv_bytes(sock, memoryview(raw), src, deadline, who)
        if bytes(raw) != mine:
            expected = (f"rank {self._rank}: recv from rank {src} expected "
                        f"{describe_header(mine).replace('send', 'a message', 1)} but rank {src} "
                        f"sent {describe_header(bytes(raw))}")
            raise MismatchError(expected + self._resynchronise(sock, bytes(raw), src, deadline, who, expected))
        self._recv_bytes(sock, byte_view(buf), src, deadline, who)
        check = self._p2p_integrity("p2p", src, self._rank)
        if check is not None:
            trailer = bytearray(check.size)
            self._recv_bytes(sock, memoryview(trailer), src, deadline, who)
            problem = check.check(byte_view(buf), trailer)
            if problem is not None:
                raise IntegrityError(f"rank {self._rank}: checksum mismatch on a {buf.nbytes}-byte message "
                                     f"from {self._who(src)}: {problem}")

    def _p2p_integrity(self, kind: str, sender: int, receiver: int) -> integrity.Integrity | None:
        """The trailer of the point-to-point stream sender -> receiver (one per connection: a
        MAC counts its messages, under a key of that connection alone); set by _p2p_connected."""
        return self._integrity.get((sender, receiver)) if self._verify else None

    def _p2p_connected(self, sender: int, receiver: int, hello: tcp.Hello) -> None:
        """A point-to-point connection sender -> receiver was set up: its own trailers."""
        if self._verify:
            peer = receiver if sender == self._rank else sender
            self._integrity[(sender, receiver)] = integrity.for_link(
                self._verify, self._auth, self._token, self._rank, peer, f"p2p {sender}->{receiver}", hello.session)

    def _recv_bytes(self, sock: socket.socket, view: memoryview, src: int, deadline: float, who: str) -> None:
        """Fill view from src's spill buffer first, then its stream (caller holds src's receive lock).
        The deadline measures silence: each byte that arrives restarts it."""
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        spill = self._spill[src]
        while spill and len(view):
            chunk = spill[0]
            n = min(len(chunk), len(view))
            view[:n] = chunk[:n]
            view = view[n:]
            self._spilled[src] -= n
            if n == len(chunk):
                spill.popleft()
            else:
                spill[0] = chunk[n:]
        if not len(view):
            return
        if not spill:
            self._spill_ended.discard(src)
        tcp.recv_exact(sock, view, deadline, who, silence=self.timeout)

    def _resynchronise(self, sock: socket.socket, raw: bytes, src: int, deadline: float, who: str,
                       reason: str) -> str:
        """After a header that is not the expected one: drain the message it announces so the next
        recv starts at the next message, or (a header that announces no message) close the stream
        and mark it unusable. Returns what was done, for the error message."""
        magic, op, _, _, nbytes, _ = HEADER.unpack(raw)
        if magic == HEADER_MAGIC and op == OP_SEND and 0 <= nbytes:
            check = self._p2p_integrity("p2p", src, self._rank)
            remaining = nbytes + (check.size if check is not None else 0)
            if check is not None:
                check.skip()  # the drained message counts, so a MAC's message counter stays in step
            scratch = memoryview(bytearray(min(remaining, 1 << 20) or 1))
            try:
                while remaining:
                    step = min(remaining, len(scratch))
                    self._recv_bytes(sock, scratch[:step], src, deadline, who)
                    remaining -= step
            except DistributedError as exc:
                self._mark_p2p_unusable(src, f"{reason}; draining its payload failed: {exc}")
                return f"; draining its payload failed, so the stream from rank {src} is now unusable"
            return f"; its {nbytes}-byte payload was discarded, the next recv from rank {src} reads its next message"
        self._mark_p2p_unusable(src, reason)
        return f"; the stream from rank {src} is out of step, so it is now closed and unusable"

    def _mark_p2p_unusable(self, src: int, reason: str) -> None:
        with self._p2p_lock:
            self._p2p_unusable[src] = reason
            sock = self._p2p_in.pop(src, None)
        if sock is not None:
            sock.close()

    def split(self, color: int, key: int) -> "RingBackend":
        """Form sub-rings: fresh listeners, addresses exchanged over this ring."""
        self.failure.check()
        if self._size == 1:
            return RingBackend(0, self._addresses, [], self.timeout, self._connect_timeout, job=self._auth)
        k = min(len(a) for a in self._addresses)
        # Sub-ring connection c listens on the host of this rank's address c, so a sub-ring
        # uses the same interfaces as its parent.
        hosts = [tcp.parse_address(a)[0] for a in self._addresses[self._rank][:k]]
        listeners: list[tcp.Listener] = []
        try:
            for host in hosts:
                listeners.append(tcp.Listener(host, 0))
        except DistributedError as exc:
            for s in listeners:
                s.close()
            self._abandon_split(self._rank)  # the others must not wait for this rank's record
            raise type(exc)(f"rank {self._rank}: split(color={color}): {exc}") from None
        try:
            entries = self._gather_split_records(color, key, listeners)
        except BaseException:
            for s in listeners:
                s.close()
            raise
        colors, keys = [e["color"] for e in entries], [e["key"] for e in entries]
        members = [entries[p] for p in split_members(colors, keys, color)]
        new_rank = [e["rank"] for e in members].index(self._rank)
        if len(members) == 1:
            for s in listeners:
                s.close()
            listeners = []
        sub_ranks = {p: split_members(colors, keys, colors[p]).index(p) for p in range(self._size)}
        self._describe_member = lambda p: (f"parent rank {p} (rank {sub_ranks[p]} of the sub-group of color "
                                           f"{entries[p]['color']})")
        self._task, self._forming, self._member_word = "the split", "the sub-groups", "parent rank"
        self._abandoned = SplitAbandoned
        what = f"rank {self._rank}: split(color={color}) (rank {new_rank} of its sub-group)"
        # While the sub-rings connect, each rank watches its parent links (and the sub-ring's
        # connections made so far) for a death or an abort.
        watch = Watch(find_abort, self._abort_header, self._abort_text, self._describe_member, self._forming,
                      SplitAbandoned)
        for link in self.right + self.left:
            watch.add(link.sock, link.peer)
        try:
            # A sub-ring keeps the job secret; without one its key follows its own addresses.
            sub = RingBackend(new_rank, [e["addrs"] for e in members], listeners, self.timeout,
                              self._connect_timeout, job=self._auth if self._auth.secret else None,
                              watch=watch, parent_ranks=[e["rank"] for e in members])
        except FormationAbandoned as exc:
            self._abandon_split(exc.culprit, exc.missing)
            raise blaming(PeerError(f"{what}: {exc}"), exc.culprit) from None
        except DistributedError as exc:
            try:
                watch.check()  # the sub-group's failure is often the echo of a death in the parent
            except FormationAbandoned as cause:
                self._abandon_split(cause.culprit, cause.missing)
                raise blaming(PeerError(f"{what}: {cause} ({exc})"), cause.culprit) from None
            self._abandon_split(-1)
            raise blaming(type(exc)(f"{what}: {exc}"), getattr(exc, "missing_rank", None)) from None
        sub._formation_text = None
        self._abandon_on_failure = True
        try:
            self.barrier()  # every rank formed its sub-group: the formation ends together everywhere
        except DistributedError as exc:
            sub.close()
            neighbours = "; ".join(self._describe_member(p) for p in sorted({link.peer for link in self.right}
                                                                            | {link.peer for link in self.left}))
            raise blaming(PeerError(f"{what}: the sub-groups did not form on every rank: {exc} "
                                    f"(this rank's parent neighbours: {neighbours})"),
                          getattr(exc, "culprit", getattr(exc, "peer", (getattr(exc, "waiting_on", None) or [None])[0]))) from None
        finally:
            self._abandon_on_failure = False
        return sub

    def _gather_split_records(self, color: int, key: int, listeners: list[tcp.Listener]) -> list[dict]:
        k = len(listeners)
        mine = json.dumps({"color": color, "key": key, "rank": self._rank,
                           "addrs": [tcp.format_address(s.getsockname()[:2]) for s in listeners]}).encode()
        # Same size on every rank (k is): room for k of the longest "[ipv6]:port" plus the ints.
        record = np.zeros(128 + 56 * k, np.uint8)
        if len(mine) > record.size:
            raise ConfigError(f"rank {self._rank}: split record too long ({len(mine)} bytes)")
        record[:len(mine)] = np.frombuffer(mine, np.uint8)
        table = np.empty(record.size * self._size, np.uint8)
        header = HEADER.pack(HEADER_MAGIC, OP_SPLIT, dtype_code(np.uint8), self._seq, record.nbytes, 0)

        def run() -> None:
            for q, part in enumerate(self._small_gather(header, byte_view(record))):
                table[q * record.size:(q + 1) * record.size] = np.frombuffer(part, np.uint8)
        self._collective(header, run)
        size = record.size
        return [json.loads(bytes(table[q * size:(q + 1) * size]).rstrip(b"\0")) for q in range(self._size)]

    def _abort_text(self, reporter: int, culprit: int, missing: bool = False) -> str:
        if missing:
            who = self._who(culprit) if self._task == "forming the group" else self._describe_member(culprit)
            return f"{who} did not connect before the deadline (reported by {self._member_word} {reporter})"
        if culprit == reporter:
            return f"{self._describe_member(reporter)} gave up {self._task} after an error of its own"
        if culprit < 0:
            return f"{self._describe_member(reporter)} gave up {self._task}"
        return (f"{self._describe_member(culprit)} died or gave up while {self._forming} formed "
                f"(reported by {self._member_word} {reporter})")

    def _abandon_split(self, culprit: int, missing: bool = False) -> None:
        """Tell both ring neighbours (who tell theirs) that the split (or, in init's closing
        barrier, the formation) failed and why, then stop writing: each neighbour's poll wakes
        on the end of the stream, so the news crosses a hop as soon as it arrives."""
        abort = self._abort_header(culprit, missing)
        for link in self.right + self.left:
            try:
                link.sock.send(abort, socket.MSG_DONTWAIT)
                link.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        what = "a split of this group" if self._task == "the split" else "forming this group"
        self.failure.mark(f"rank {self._rank}: {what} failed")

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self._hier is not None:
            self._hier.close()
            self._hier = None
        for link in self.right + self.left:
            link.close()
        self.right, self.left = [], []
        with self._p2p_lock:
            for sock in list(self._p2p_out.values()) + list(self._p2p_in.values()):
                sock.close()
            self._p2p_out.clear()
            self._p2p_in.clear()
        for sock in self._listeners:
            sock.close()
        self._listeners = []
        self.failure.mark(f"rank {self._rank}: the ring group was closed")

    # ---- collective plumbing --------------------------------------------------------------

    def _header(self, op: int, arr: np.ndarray, extra: int) -> bytes:
        code = DTYPE_CODES.get(arr.dtype) or dtype_code(arr.dtype)
        return HEADER.pack(HEADER_MAGIC, op, code, self._seq, arr.nbytes, extra + self._stage)

    def _collective(self, header: bytes, body, *args) -> None:
        """Run one collective, body(*args): serialised, sequence-numbered, and fatal to the group
        on error (the links are closed so the neighbours fail fast instead of waiting for the
        deadline)."""
        with self._lock:
            self.failure.check()
            self._seq += 1
            self._deadline = time.monotonic() + self.timeout
            self._what = _Described(header)
            try:
                body(*args)
            except BaseException as exc:
                if self._abandon_on_failure:  # a split's closing barrier: pass the verdict on first
                    self._abandon_split(exc.culprit if isinstance(exc, FormationAbandoned)
                                        else getattr(exc, "peer", (getattr(exc, "waiting_on", None) or [-1])[0]),
                                        getattr(exc, "missing", False))
                # Name the rank that failed first, not the neighbour that passed the failure on,
                # and tell the other neighbour before the links close (origin.py).
                on_sockets = self._shm is None or origin.from_ring_links(exc)  # a split's records go so
                by_ring = on_sockets and self._hier is None and not self._abandon_on_failure
                named = origin.blame(self, exc) if by_ring else exc
                self.failure.mark(f"{type(named).__name__}: {named}")
                if by_ring and isinstance(named, Exception):
                    origin.notify(self, named)
                self._close_links()
                if named is exc:
                    raise
                raise named from None

    def _close_links(self) -> None:
        for link in self.right + self.left:
            link.reset()
            link.close()

    def break_links(self, why: str) -> None:
        """Close the ring links (the neighbours waiting on them fail at once) and fail every
        later collective; the listeners stay, so a notice already sent can still be taken."""
        self.failure.mark(why)
        self._close_links()

    def _run(self) -> None:
        self.engine.run(self._deadline, self._what)  # type: ignore[union-attr]

    def _buffer(self, tag: str, dtype: np.dtype, count: int) -> np.ndarray:
        """Reusable scratch memory (allocated once per tag and dtype, grown when needed)."""
        key = (tag, dtype)
        buf = self._pool.get(key)
        if buf is None or buf.size < count:
            buf = np.empty(max(count, 1), dtype)
            self._pool[key] = buf
        return buf[:count]

    def _small_bytes(self, nbytes: int) -> memoryview:
        """A reusable byte buffer for small messages (its memoryview is cached: this is the hot path)."""
        view = self._small_view
        if view is None or len(view) < nbytes:
            view = self._small_view = memoryview(bytearray(max(nbytes, 4096)))
        return view[:nbytes]

    def _one_pass(self, nbytes: int) -> bool:
        """Whether a reduction of nbytes takes the one-pass path (each rank sends (n-1) x nbytes
        in n-1 hops) rather than reduce-scatter + all-gather (2(n-1)/n x nbytes in 2(n-1) hops).
        Two ranks send the same either way; more ranks take the one pass only while what it
        sends stays under JACKLRING_RING_ONE_PASS_BYTES, where latency, not bytes, sets the time
        (between hosts; a ring entirely on this host keeps the one pass up to the small limit)."""
        if nbytes > self._small_limit:
            return False
        return self._size <= 2 or nbytes * (self._size - 1) <= self._one_pass_limit

    def _check_header(self, mine: bytes, raw: memoryview, sender: int) -> None:
        if raw[:HEADER.size] != mine:
            theirs = bytes(raw[:HEADER.size])
            magic, op, reason, reporter, _, culprit = HEADER.unpack(theirs)
            if magic == HEADER_MAGIC and op == OP_ABORT:
                missing = reason == ABORT_MISSING
                explain = self._formation_text or self._abort_text
                raise self._abandoned(culprit, f"rank {self._rank}: {explain(reporter, culprit, missing)}", missing)
            request = header_request(theirs)
            if request is None:
                raise MismatchError(f"rank {self._rank}: rank {sender} sent {describe_header(theirs)} "
                                    f"during {describe_header(mine)}")
            # Headers carry the count of collectives before theirs (packed before _collective counts it).
            step = "" if reporter + 1 == self._seq else f" (its operation #{reporter + 1}; this rank's #{self._seq})"
            raise origin.mismatch(self._rank, sender, mismatch_message(self._rank, sender, header_request(mine),
                                                                       request, step))

    def _small_gather(self, header: bytes, data: memoryview) -> list[memoryview]:
        """Ring all-gather of header+data messages along the forward direction; each message
        keeps its origin's header, so every rank checks every other rank's request."""
        n, r = self._size, self._rank
        size = HEADER.size + len(data)
        gathered = self._small_bytes(size * n)
        mine = gathered[r * size:(r + 1) * size]
        mine[:HEADER.size] = header
        mine[HEADER.size:] = data
        out, inp = self.right[0], self.left[0]
        out.post_send(mine)
        for step in range(n - 1):
            q = (r - step - 1) % n
            view = gathered[q * size:(q + 1) * size]

            def done(view=view, q=q, forward=step < n - 2) -> None:
                self._check_header(header, view, q)
                if forward:
                    out.post_forward(view, inp)

            def truncated(got: int, view=view, q=q) -> None:
                if got >= HEADER.size:
                    self._check_header(header, view, q)
            inp.post_recv(view, done, truncated)
        self._run()
        return [gathered[q * size + HEADER.size:(q + 1) * size] for q in range(n)]

    def _small_all_reduce(self, header: bytes, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        parts = self._small_gather(header, byte_view(src))
        reduce_many(dst, [np.frombuffer(p, src.dtype) for p in parts], op)

    def _channels(self) -> list[Channel]:
        n, r = self._size, self._rank
        forward = [Channel(out, inp, r) for out, inp in zip(self.right, self.left)]
        if not self._both_directions:
            return forward
        backward = [Channel(out, inp, n - 1 - r) for out, inp in zip(self.left, self.right)]
        return forward + backward

    @staticmethod
    def _rank_at(ch_index: int, n_forward: int, n: int, pos: int) -> int:
        return pos if ch_index < n_forward else n - 1 - pos

    def _exchange_headers(self, header: bytes) -> None:
        """Each link carries this rank's header out and the neighbour's header in."""
        for link in self.right + self.left:
            link.post_send(memoryview(header))
            raw = bytearray(HEADER.size)
            link.post_recv(memoryview(raw), lambda raw=raw, peer=link.peer: self._check_header(header, memoryview(raw), peer))

    def _large(self, header: bytes, src: np.ndarray, dst: np.ndarray, blocks: list[tuple[int, int]],
               op: ReduceOp, gather: bool) -> None:
        """Reduce-scatter (+ all-gather when gather) over every channel. blocks[i] is rank i's
        block of src; without gather, dst is this rank's block only."""
        n = self._size
        channels = self._channels()
        n_forward = len(self.right)
        seg = max(1, self._segment_bytes // src.itemsize)
        work = dst if gather else self._buffer("rs-work", src.dtype, src.size)
        self._exchange_headers(header)
        for ci, ch in enumerate(channels):
            s_chunks, a_chunks = [], []
            for pos in range(n):
                owner = self._rank_at(ci, n_forward, n, pos)
                lo, hi = blocks[owner]
                plo, phi = split_evenly(hi - lo, len(channels))[ci]
                s_chunks.append(src[lo + plo:lo + phi])
                if not gather and owner == self._rank:
                    a_chunks.append(dst[plo:phi])
                else:
                    a_chunks.append(work[lo + plo:lo + phi])
            scratch = self._buffer(f"scratch{ci}", src.dtype, seg)
            reduce_scatter_all_gather(ch, n, s_chunks, a_chunks, a_chunks if gather else None, op, scratch, seg)
        self._run()

    def _large_gather(self, header: bytes, src: np.ndarray, dst: np.ndarray) -> None:
        n, m = self._size, src.size
        channels = self._channels()
        n_forward = len(self.right)
        seg = max(1, self._segment_bytes // src.itemsize)
        dst[self._rank * m:(self._rank + 1) * m] = src
        self._exchange_headers(header)
        for ci, ch in enumerate(channels):
            plo, phi = split_evenly(m, len(channels))[ci]
            chunks = []
            for pos in range(n):
                owner = self._rank_at(ci, n_forward, n, pos)
                chunks.append(dst[owner * m + plo:owner * m + phi])
            ring_all_gather(ch, n, chunks, seg)
        self._run()

    def _broadcast(self, header: bytes, buf: np.ndarray, root: int) -> None:
        n = self._size
        channels = self._channels()
        n_forward = len(self.right)
        seg = max(1, self._segment_bytes // max(1, buf.itemsize))
        self._exchange_headers(header)
        for ci, ch in enumerate(channels):
            plo, phi = split_evenly(buf.size, len(channels))[ci]
            root_pos = root if ci < n_forward else n - 1 - root
            chain_broadcast(ch, n, root_pos, buf[plo:phi], seg)
        self._run()

    # ---- same-host shared memory (see shared.py) -------------------------------------------

    def _attach_shared_memory(self) -> None:
        self._shm_small = config.get("JACKLRING_SHM_SMALL_BYTES")
        self._shm_one_step = -1  # the largest all_reduce that takes the one-step path (set below)

        def gather(record: bytes) -> list[bytes]:
            header = HEADER.pack(HEADER_MAGIC, OP_SHM, dtype_code(np.uint8), self._seq, len(record), 0)
            parts: list[bytes] = []
            self._collective(header, lambda: parts.extend(
                bytes(p) for p in self._small_gather(header, memoryview(record))))
            return parts
        placement = shared.attach(self, gather)
        if not placement.shared:
            return
        if len(placement.hosts) == 1:
            self._shm = placement.group
            self._shm_one_step = min(self._shm_small, self._shm.chunk_bytes)
            return
        try:
            self._hier = hierarchy.form(self, placement)
        except BaseException:
            if placement.group is not None:
                placement.group.close()
            raise

    def _shared(self, header: bytes, body, *args) -> bool:
        """Run a collective over shared memory when this group has it (else return False).
        A split's closing barrier stays on the ring: its failure handling passes the verdict on
        over the ring links."""
        if self._shm is None or self._abandon_on_failure:
            return False
        self._collective(header, shared.run, self, body, header, *args)
        return True

    def _staged(self, header: bytes, body, *args) -> bool:
        """Run a collective in stages (hierarchy.py) when this group spans hosts and shares
        memory on some (else return False); like _shared, never a split's closing barrier."""
        if self._hier is None or self._abandon_on_failure:
            return False
        self._collective(header, hierarchy.run, self, body, header, *args)
        return True

    # ---- point to point -------------------------------------------------------------------

    def _p2p_out_socket(self, dst: int, deadline: float) -> socket.socket:
        with self._p2p_lock:
            sock = self._p2p_out.get(dst)
        if sock is None:
            addr = tcp.parse_address(self._addresses[dst][0])
            hello = tcp.Hello(PURPOSE_P2P, self._rank, dst, 0, self._token)
            try:
                sock, hello = tcp.connect_with_hello(addr, hello, deadline, f"rank {dst}", self._auth)
            except PeerError as exc:
                raise PeerError(f"rank {self._rank}: send: {exc}") from None
            self._p2p_connected(self._rank, dst, hello)
            with self._p2p_lock:
                self._p2p_out[dst] = sock
        return sock

    def _check_alive(self, peer: int) -> None:
        """Raise PeerError if peer is gone: its ring link (for a neighbour) reads end-of-file, or
        its listening address refuses connections. Used while waiting for a message from it."""
        gone = f"rank {self._rank}: recv: rank {peer} ({self._addresses[peer][0]}) exited before sending"
        for link in self.right + self.left:
            if link.peer != peer:
                continue
            try:
                if link.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    raise PeerError(gone + " (its ring connection closed)")
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                if not isinstance(exc, PeerError):
                    raise PeerError(f"{gone} ({exc.strerror or exc})") from None
                raise
        host, port = tcp.parse_address(self._addresses[peer][0])
        try:
            with socket.create_connection((host, port), timeout=1.0):
                pass  # connected and closed without a word: the listener drops it quietly
        except ConnectionRefusedError:
            raise PeerError(gone + " (nothing listens on its address any more)") from None
        except OSError:
            pass  # unreachable or slow is not proof of death; the deadline still applies

    def _p2p_in_socket(self, src: int, deadline: float) -> socket.socket:
        next_liveness_check = time.monotonic() + 0.2
        while True:
            with self._p2p_lock:
                sock = self._p2p_in.get(src)
            if sock is not None:
                return sock
            now = time.monotonic()
            if now >= deadline:
                # The peer is alive (checked below) but sent nothing: a deadline, not a death.
                raise CollectiveTimeout(f"rank {self._rank}: recv: no message from rank {src} "
                                        f"({self._addresses[src][0]}) within the {self.timeout:g} s deadline; "
                                        f"it is alive but never connected to send")
            if now >= next_liveness_check:
                self._check_alive(src)
                next_liveness_check = now + 1.0
            taken = self._listeners[0].take(lambda h: h.purpose == PURPOSE_P2P and h.sender == src,
                                            min(deadline, time.monotonic() + 0.2), None)
            if taken is not None:
                self._p2p_connected(src, self._rank, taken[1])
                with self._p2p_lock:
                    old = self._p2p_in.get(src)
                    self._p2p_in[src] = taken[0]
                if old is not None:
                    old.close()
