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

This class composes the parts, which share one RingState (state.py): addresses.py (the
hostfile), forming.py (connecting the ring), plumbing.py (what every collective runs on),
point_to_point.py (send/recv), splitting.py (split), shared.py (shared memory; in stages through local/staged.py).
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from ... import config, logs
from ...config import connect_timeout as default_connect_timeout
from ...config import env_rank, op_timeout
from ...errors import ABORT, ConfigError, DistributedError, PeerError, blaming
from ..base import Backend, ReduceOp
from ..elastic import membership, shrinking
from ..local import staged
from ..local.segment import SharedGroup
from ..protocol import REDUCE_CODES
from ..transport import auth, layout, tcp
from ..transport.stream_engine import Engine, Stream
from . import grow, lineage, origin, shared, shrink, splitting
from .addresses import links_per_neighbour, load_ring_hostfile, refuse_open_hosts, validate_addresses
from .formation import FormationAbandoned, LayoutMismatch, Watch
from .forming import (
    ABORT_NOTICE_S,
    CANNOT_LISTEN_NOTICE_S,
    LAYOUT_LINGER_S,
    Forming,
    Wording,
    admit,
    tell_cannot_listen,
)
from .header import (
    HEADER,
    HEADER_MAGIC,
    OP_ALL_GATHER,
    OP_ALL_REDUCE,
    OP_BARRIER,
    OP_BROADCAST,
    OP_REDUCE_SCATTER,
    PURPOSE_ABORT,
    PURPOSE_P2P,
    PURPOSE_RING,
    PURPOSE_SHRINK,
    stage_tag,
)
from .plumbing import Plumbing
from .point_to_point import SPILL_CHUNK, SPILL_POLL_S, PointToPoint
from .scheduled import RingPeers, Scheduled
from .splitting import SplitAbandoned
from .state import RingState

# Importable from here as before the parts moved out.
__all__ = ["ABORT_NOTICE_S", "PURPOSE_ABORT", "PURPOSE_P2P", "PURPOSE_RING", "SPILL_CHUNK", "SPILL_POLL_S",
           "RingBackend", "RingState", "SplitAbandoned", "create", "load_ring_hostfile", "probe",
           "validate_addresses"]


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
    try:
        rank = env_rank(len(addresses), f"MLX_HOSTFILE {path!r}")
    except ConfigError:
        _witness_layout(addresses, _incarnations + 1)
        raise
    refuse_open_hosts(addresses, f"MLX_HOSTFILE {path!r}")
    if config.get("JACKLRING_JOIN"):  # a replacement: the members take it in with grow()
        return grow.join_ring(RingBackend, rank, lineage.HostfileOrigin(addresses), timeout, default_connect_timeout())
    _incarnations += 1
    backend = RingBackend.from_addresses(rank, addresses, timeout=timeout, incarnation=_incarnations,
                                         layout_check=True)
    lineage.record(backend, lineage.Lineage(lineage.HostfileOrigin(addresses), list(range(len(addresses)))))
    return backend


def _witness_layout(addresses: list[list[str]], incarnation: int) -> None:
    """This rank's hostfile contradicts the launcher's WORLD_SIZE: before it raises, it listens
    where its hostfile puts it for LAYOUT_LINGER_S and answers layout checks there (nothing
    else), so the ranks of the other view that meet it learn that the layouts differ and raise
    a ConfigError too, instead of waiting for their connect deadline (transport/layout.py)."""
    raw = os.environ.get("MLX_RANK", "")
    rank = int(raw) if raw.strip().lstrip("-").isdigit() else -1
    if not 0 <= rank < len(addresses) or len(addresses) < 2:
        return  # no place of its own in its hostfile: nobody could meet it there
    try:
        check = layout.check_for(rank, addresses)
    except ConfigError:
        return
    if check is None:
        return  # no job secret: nothing can be compared
    listeners: list[tcp.Listener] = []
    try:
        context = json.dumps([addresses, incarnation]).encode()
        keys = auth.job_auth(context, "the ring", salt=json.dumps(addresses).encode())
        for c, addr in enumerate(addresses[rank]):
            listener = tcp.Listener(*tcp.parse_address(addr))
            listeners.append(listener)
            listener.serve(keys, auth.context_id(context), rank, lambda h: "its configuration is wrong",
                           f"rank {rank}", (check, addr))
        time.sleep(LAYOUT_LINGER_S)
    except DistributedError:
        pass
    finally:
        for listener in listeners:
            listener.close()


def _copy(src: np.ndarray, dst: np.ndarray) -> None:
    if dst is not src:
        dst[...] = src


class RingBackend(Backend):
    name = "ring"

    @classmethod
    def from_addresses(cls, rank: int, addresses: list[list[str]], timeout: float | None = None,
                       connect_timeout: float | None = None, incarnation: int = 0,
                       job: auth.Auth | None = None, layout_check: bool = False) -> "RingBackend":
        """Listen on this rank's addresses and connect the ring (the constructor a store-based
        rendezvous, such as torch's, uses). layout_check: the addresses are this rank's hostfile,
        compared with a rank that answers as another job (transport/layout.py)."""
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
            error = PeerError(f"rank {rank}: {exc}")
            tell_cannot_listen(rank, addresses, cls.context_token(addresses, incarnation),
                               cls.job_keys(addresses, incarnation, job), CANNOT_LISTEN_NOTICE_S)
            raise error from None
        return cls(rank, addresses, listeners, timeout, connect_timeout, incarnation, job,
                   check=layout.check_for(rank, addresses) if layout_check else None)

    def __init__(self, rank: int, addresses: list[list[str]], listeners: list[tcp.Listener],
                 timeout: float | None, connect_timeout: float | None, incarnation: int = 0,
                 job: auth.Auth | None = None, watch: Watch | None = None,
                 parent_ranks: list[int] | None = None, peers_listening: bool = False,
                 check: layout.Check | None = None, decided: bool = False) -> None:
        self._rank, self._size = rank, len(addresses)
        seconds = op_timeout(timeout)
        connect_seconds = default_connect_timeout(connect_timeout)
        # The job context is the address list and the incarnation (how many rings this process
        # formed from the same hostfile: a re-formed ring's connections never count in a listener
        # of the ring closed before it). The key is the job secret (or, without one, derived from
        # that public context: see transport/auth.py).
        token = self.context_token(addresses, incarnation)
        keys = self.job_keys(addresses, incarnation, job)
        state = self._state = RingState(rank, self._size, addresses, listeners, token, keys, seconds,
                                        connect_seconds, config.get("JACKLRING_VERIFY"), self.failure)
        # What an abort header is about (a split's parent rewords these for the sub-groups).
        self._words = Wording(state)
        self._forming = Forming(state, self._words, watch, parent_ranks, peers_listening, check, decided)
        self._plumbing = plumbing = Plumbing(state, self._words)
        self._p2p = PointToPoint(state, plumbing.small_limit)
        # Log-latency schedules over the point-to-point connections (scheduled.py), by size and group size.
        self._scheduled = Scheduled(RingPeers(rank, self._size, self._p2p, plumbing.check_header), plumbing.buffer,
                                    between_hosts=not plumbing.on_one_host)
        plumbing.on_close.append(self._p2p.drop_streams)
        self._collective = plumbing.collective
        self._shm_small = -1   # JACKLRING_SHM_SMALL_BYTES, once shared memory is attached
        self._shm_one_step = -1  # the largest all_reduce that takes the one-step path
        logs.apply_verbose_setting()  # MLX_RING_VERBOSE: jacklring's own handler, never the root logger's
        if self._size > 1:
            k = links_per_neighbour(addresses)
            try:
                for c, listener in enumerate(listeners):
                    listener.serve(keys, token, rank, lambda h, c=c, k=k: admit(state, h, c, k), f"rank {rank}",
                                   None if check is None else (check, addresses[rank][c]))
                self._forming.connect()
                if watch is None:
                    self._forming.finish(self.barrier)  # a split's parent runs the closing barrier instead
                self._attach_shared_memory()
                if state.shm is None and state.standby is not None:
                    # Collectives over the ring links wait on the neighbours: their words after a
                    # deadline come over standby connections, without a handshake (standby.py).
                    for q in ((rank + 1) % self._size, (rank - 1) % self._size):
                        state.standby.watch(q)
            except BaseException as exc:
                self._forming.give_up(exc, tell_unlinked=watch is None)
                self.close()  # the listeners, so a failed formation leaves no fd behind
                if watch is None and isinstance(exc, LayoutMismatch):
                    raise blaming(ConfigError(str(exc)), exc.culprit, how=ABORT) from None
                if watch is None and isinstance(exc, FormationAbandoned):
                    raise blaming(PeerError(str(exc)), exc.culprit, how=ABORT) from None
                raise blaming(exc, getattr(exc, "missing_rank", None))

    @staticmethod
    def job_keys(addresses: list[list[str]], incarnation: int, job: auth.Auth | None) -> auth.Auth:
        """The ring's key: `job` when given (a shrunk or grown group's), else the job secret's (or,
        without one, derived from the public context: the address list and the incarnation)."""
        if job is not None:
            return job
        context = json.dumps([addresses, incarnation]).encode()
        # The secret's stretch is salted by the addresses alone: it runs once for every incarnation.
        return auth.job_auth(context, "the ring", salt=json.dumps(addresses).encode())

    @staticmethod
    def context_token(addresses: list[list[str]], incarnation: int) -> int:
        """The job context id of the ring of these addresses and incarnation (every hello carries it)."""
        return auth.context_id(json.dumps([addresses, incarnation]).encode())

    # ---- what other parts of the ring use ---------------------------------------------------

    @property
    def state(self) -> RingState:
        """The group's shared state: its links, keys, addresses, shared memory (state.py)."""
        return self._state

    @property
    def timeout(self) -> float:
        return self._state.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._state.timeout = seconds

    @property
    def right(self) -> list[Stream]:
        return self._state.right

    @property
    def left(self) -> list[Stream]:
        return self._state.left

    @property
    def engine(self) -> Engine | None:
        return self._state.engine

    def split_formed(self) -> None:
        """Called by the parent once this sub-group formed: an abort header read here no longer
        names parent ranks."""
        self._words.formation_text = None

    def break_links(self, why: str) -> None:
        """Close the ring links (the neighbours waiting on them fail at once) and fail every
        later collective; the listeners stay, so a notice already sent can still be taken."""
        self.failure.mark(why)
        if self._state.shm is not None:
            # A collective waiting on the segment sleeps in poll(), which closing the links does
            # not wake: this rank's mark rings every waiter, its own thread's too.
            self._state.shm.mark_broken()
        self._plumbing.close_links()

    # ---- Backend interface ----------------------------------------------------------------

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def all_reduce(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        if self._size == 1:
            return _copy(src, dst)
        plumbing = self._plumbing
        header = plumbing.header(OP_ALL_REDUCE, src, REDUCE_CODES[op])
        state = self._state
        if state.shm is not None and src.nbytes <= self._shm_one_step and not state.abandon_on_failure:
            # The small-message hot path: what _shared does, one call shorter.
            plumbing.on_shared(header, state.shm, SharedGroup.all_reduce, src, dst, op)
            return
        if self._shared(header, SharedGroup.all_reduce, src, dst, op):
            return
        if self._staged(header, staged.all_reduce, src, dst, op):
            return
        choice = self._scheduled.choose("all_reduce", src.nbytes)
        if choice != "native" and not state.abandon_on_failure:
            self._collective(header, self._scheduled.all_reduce, header, choice, src, dst, op)
            return
        plumbing.all_reduce(header, src, dst, op)

    def reduce_scatter(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        if self._size == 1:
            return _copy(src, dst)
        plumbing = self._plumbing
        header = plumbing.header(OP_REDUCE_SCATTER, src, REDUCE_CODES[op])
        if self._shared(header, SharedGroup.reduce_scatter, src, dst, op):
            return
        if self._staged(header, staged.reduce_scatter, src, dst, op):
            return
        if self._scheduled.choose("reduce_scatter", src.nbytes) != "native" and not self._state.abandon_on_failure:
            self._collective(header, self._scheduled.reduce_scatter, header, src, dst, op)
            return
        plumbing.reduce_scatter(header, src, dst, op)

    def set_timeout(self, seconds: float) -> None:
        self.timeout = config.check_seconds(float(seconds), "timeout")

    def all_gather(self, src: np.ndarray, dst: np.ndarray) -> None:
        if self._size == 1:
            return _copy(src, dst)
        plumbing = self._plumbing
        header = plumbing.header(OP_ALL_GATHER, src, 0)
        if self._shared(header, SharedGroup.all_gather, src, dst):
            return
        if self._staged(header, staged.all_gather, src, dst):
            return
        if self._scheduled.choose("all_gather", src.nbytes) != "native" and not self._state.abandon_on_failure:
            self._collective(header, self._scheduled.all_gather, header, src, dst)
            return
        plumbing.all_gather(header, src, dst)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if not 0 <= root < self._size:
            raise ValueError(f"broadcast root {root} is out of range for {self._size} ranks")
        if self._size == 1:
            return
        plumbing = self._plumbing
        header = plumbing.header(OP_BROADCAST, buf, root)
        if self._shared(header, SharedGroup.broadcast, buf, root):
            return
        if self._staged(header, staged.broadcast, buf, root):
            return
        if self._scheduled.choose("broadcast", buf.nbytes) != "native" and not self._state.abandon_on_failure:
            self._collective(header, self._scheduled.broadcast, header, buf, root)
            return
        plumbing.broadcast(header, buf, root)

    def barrier(self) -> None:
        if self._size == 1:
            return
        header = HEADER.pack(HEADER_MAGIC, OP_BARRIER, 0, self._state.seq, 0, 0)
        if self._shared(header, SharedGroup.barrier):
            return
        if self._staged(header, staged.barrier):
            return
        if self._scheduled.choose("barrier", 0) != "native" and not self._state.abandon_on_failure:
            self._collective(header, self._scheduled.barrier, header)
            return
        self._plumbing.barrier(header)

    def send(self, buf: np.ndarray, dst: int) -> None:
        self._p2p.send(buf, dst)

    def recv(self, buf: np.ndarray, src: int) -> None:
        self._p2p.recv(buf, src)

    def split(self, color: int, key: int) -> "RingBackend":
        """Form sub-rings: fresh listeners, addresses exchanged over this ring."""
        return splitting.split(self, self._state, self._words, self._plumbing, color, key)

    def shrink(self, exclude: list[int], min_size: int | None, timeout: float) -> "RingBackend":
        """A ring of the old members that are still alive (ring/shrink.py)."""
        state = self._state
        if not state.listeners:
            raise DistributedError(f"rank {state.rank}: this ring group was closed; it cannot shrink")
        seat = membership.Seat(state.rank, [a[0] for a in state.addresses], state.listeners[0], state.auth,
                               state.token, PURPOSE_SHRINK)
        return shrink.shrink_ring(self, seat, state.addresses, exclude, min_size, timeout)

    def grow(self, count: int | None, timeout: float) -> "RingBackend":
        """A ring of the members and newcomers that wait at vacant slots of its origin (ring/grow.py)."""
        return grow.grow_ring(self, count, timeout)

    def close(self) -> None:
        state = self._state
        if state.shm is not None:
            segment, state.shm = state.shm, None  # the sequence count comes back out first
            segment.close()
        if state.hier is not None:
            state.hier.close()
            state.hier = None
        for link in state.right + state.left:
            link.close()
        state.right, state.left = [], []
        self._p2p.close()
        for sock in state.listeners:
            sock.close()
        state.listeners = []
        shrinking.release(self)  # the seats of groups that did not form on the way to this one
        self.failure.mark(f"rank {self._rank}: the ring group was closed")

    # ---- same-host shared memory (see shared.py) -------------------------------------------

    def _attach_shared_memory(self) -> None:
        self._shm_small = config.get("JACKLRING_SHM_SMALL_BYTES")
        state = self._state
        shared.attach_memory(self, state, self._plumbing)
        if state.shm is not None:
            self._shm_one_step = min(self._shm_small, state.shm.chunk_bytes)

    def whole_group_segment(self) -> "SharedGroup | None":
        """The segment that the whole group shares (every rank on this host), else None: what a
        native caller (the torch C++ Backend) may run whole collectives on, for as long as this
        group is open."""
        state = self._state
        if state.shm is None or state.hier is not None or state.abandon_on_failure or state.shm.size != self._size:
            return None
        return state.shm

    def _shared(self, header: bytes, body, *args) -> bool:
        """Run a collective over shared memory when this group has it (else return False).
        A split's closing barrier stays on the ring: its failure handling passes the verdict on
        over the ring links."""
        state = self._state
        if state.shm is None or state.abandon_on_failure:
            return False
        self._plumbing.on_shared(header, state.shm, body, *args)
        return True

    def _staged(self, header: bytes, body, *args) -> bool:
        """Run a collective in stages (local/staged.py) when this group spans hosts and shares
        memory on some (else return False); like _shared, never a split's closing barrier."""
        state = self._state
        if state.hier is None or state.abandon_on_failure:
            return False
        self._collective(header, shared.run_staged, state, body, header, *args)
        return True

    # ---- as the leaders' ring of a group spanning hosts (local/staged.py's Leaders) ---------

    def set_stage(self, op_code: int, detail: int) -> None:
        self._state.stage = stage_tag(op_code, detail) if op_code else 0

    def notify_outer(self, culprit: int) -> None:
        origin.notify_outer(self._state, culprit)

    @property
    def staging(self) -> "staged.Staging | None":
        """The staged collectives of a group spanning hosts (None: not staged)."""
        return self._state.hier
