"""The JACCL backend: a low-latency mesh (or ring) of direct links between ranks.

Environment (identical to MLX): MLX_RANK, MLX_JACCL_COORDINATOR (ip:port where rank 0 listens
for the side channel), MLX_IBV_DEVICES (N x N JSON of RDMA device names), MLX_JACCL_RING=1 to
prefer the ring (`launcher --backend jaccl-ring`).

Transport: RDMA through pyverbs when every rank has its devices, else the TCP mesh, chosen
together by all ranks over the side channel with one log line. JACKLRING_JACCL_TRANSPORT=tcp
forces TCP; =rdma requires RDMA (and fails, naming the rank and reason, without it).

Ranks that all share a host run the collectives over shared memory (local.py) unless
JACKLRING_LOCAL_TRANSPORT is unix or tcp; a group spanning hosts, some with several of its ranks,
runs them in stages (each host's memory, a mesh of one rank per host: local/staged.py); send/recv
always take the transport.

JACKLRING_JOIN=1 starts a replacement for a vacant rank: it knocks at MLX_JACCL_COORDINATOR until
the members' grow() takes it in (grow.py; the TCP mesh only).

JACKLRING_VERIFY=1 adds a CRC-32C to every frame (=mac is refused), checked on receipt; JACKLRING_STALL_REPORT
(seconds, default 30, 0 turns it off) logs once when an operation waits that long.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
import zlib
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from ... import config
from ...errors import ConfigError, DistributedError, PeerError, blaming, failure_of
from ..base import Backend, ReduceOp, split_members
from ..elastic import membership, shrinking
from ..local import staged, use
from ..singleton import SingletonBackend
from ..transport import auth, layout, mesh_forming, tcp
from ..transport.names import check_resolvable
from ..transport.slots import Transport
from . import config as jaccl_config
from . import grow, local, open_hosts, shrink
from .algorithms import MeshAlgorithms, RingAlgorithms
from .config import MESH, RING, DeviceMatrix
from .exchange import FrameExchange
from .frame_header import stage_tag
from .links import TRANSPORT_ENV, agree_on_transport, build_transport, transport_choice
from .local import SharedCollectives
from .scheduled import ScheduledMesh
from .side_channel import SideChannel

log = logging.getLogger("jacklring.jaccl")

STALL_ENV = "JACKLRING_STALL_REPORT"
DEFAULT_STALL_REPORT_S = 30.0


def probe() -> str | None:
    """None when the JACCL environment is present (validated in create()), else why not."""
    return jaccl_config.missing_variables()



def stall_report_seconds() -> float | None:
    """JACKLRING_STALL_REPORT in seconds (default 30); None when it is 0 (no report)."""
    return config.get("JACKLRING_STALL_REPORT")


_incarnations = 0  # groups this process formed from the environment (part of the job token)


def create(timeout: float | None = None) -> "Backend":
    """Validate the environment, then form the group through the side channel."""
    global _incarnations
    cfg = jaccl_config.load()
    choice = transport_choice()
    op_timeout = config.op_timeout(timeout)
    checks = Checks(config.get("JACKLRING_VERIFY"), stall_report_seconds())
    if checks.verify == "mac":  # never fall back to a checksum an attacker can recompute
        raise ConfigError("JACKLRING_VERIFY=mac is not supported by the JACCL backend yet; use "
                          "JACKLRING_VERIFY=crc (accidents) or the ring backend (mac)")
    origin = grow.Origin(tcp.format_address(cfg.coordinator), cfg.devices)
    if config.get("JACKLRING_JOIN"):  # a replacement: it knocks at the coordinator until grow() takes it in
        if choice == "rdma":
            raise ConfigError(f"rank {cfg.rank}: JACKLRING_JOIN=1 with {TRANSPORT_ENV}=rdma: a JACCL group grows on "
                              f"the TCP mesh only")
        check_resolvable(cfg.coordinator[0], f"MLX_JACCL_COORDINATOR={origin.coordinator}")
        return grow.join_mesh(cfg.rank, origin, config.connect_timeout(), _grown_builder(op_timeout, checks))
    if cfg.size == 1:
        return SingletonBackend()  # `launcher --backend jaccl -n 1`: nobody to connect to
    check_resolvable(cfg.coordinator[0], f"MLX_JACCL_COORDINATOR={tcp.format_address(cfg.coordinator)}")
    deadline = time.monotonic() + config.connect_timeout()
    _incarnations += 1
    # A group formed again after close() gets a new context: no connection of the earlier one counts.
    context = json.dumps([tcp.format_address(cfg.coordinator), cfg.devices, _incarnations]).encode()
    token = zlib.crc32(context)
    job = auth.job_auth(context, "JACCL",  # the secret's stretch: once for every incarnation
                        salt=json.dumps([tcp.format_address(cfg.coordinator), cfg.devices]).encode())
    # What every rank must share, compared under the job secret with a rank 0 that answers as
    # another job (transport/layout.py): a ConfigError on every rank instead of the deadline.
    check = layout.check_of(cfg.rank, cfg.size, [tcp.format_address(cfg.coordinator), cfg.devices])
    open_hosts.refuse_remote_coordinator(cfg.rank, cfg.coordinator, token, deadline, job)
    side = SideChannel(cfg.rank, cfg.size, cfg.coordinator, token, deadline, job, check,
                       None if job.secret else open_hosts.refuse_remote_peer,
                       keep=lambda held: grow.hold_coordinator(origin, held))
    try:
        kind = agree_on_transport(cfg, choice, side)
        host = side.local_host()
        # The side channel watches the mesh's formation: rank 0 sees every rank (verbs has no watch).
        transport = build_transport(kind, cfg.rank, cfg.size, cfg.peers(), cfg.devices[cfg.rank],
                                     host, side.all_gather, token, deadline, job, watch=side.watch)
        try:
            side.barrier()  # every queue pair / socket is ready before anyone sends
        except BaseException:
            transport.close()
            raise
    except Exception as exc:
        blaming(exc, getattr(exc, "mesh_rank", None))  # the mesh numbers ranks as the group does
        # rank 0 tells the others why, and whom it blames (no-op elsewhere)
        side.abort(f"{type(exc).__name__}: {exc}", culprit=failure_of(exc).culprit)
        raise
    finally:
        side.close()
    backend = JacclBackend(transport, cfg.devices, cfg.mode, kind, host, token, op_timeout, checks, job,
                           grow.Lineage(origin, list(range(cfg.size))))
    backend.attach_shared_memory()
    return backend


def _grown_builder(op_timeout: float, checks: "Checks") -> grow.Build:
    """How grow.py makes a backend of a grown mesh: with this process's operation timeout and
    checks (the members' and the newcomers' alike come from the job's environment)."""

    def build(transport: Transport, lin: grow.Lineage, mode: str, host: str, token: int,
              key: auth.Auth) -> JacclBackend:
        return JacclBackend.grown(transport, lin, mode, host, token, op_timeout, checks, key)

    return build


class Checks(NamedTuple):
    verify: bool                    # JACKLRING_VERIFY
    stall_report_s: float | None    # JACKLRING_STALL_REPORT



class JacclBackend(Backend):
    name = "jaccl"
    shrink_missing = ("its RDMA queue pairs are created once, from the device file (MLX_IBV_DEVICES), and "
                      "re-creating them for the survivors is not written; a JACCL group on the TCP mesh "
                      "(JACKLRING_JACCL_TRANSPORT=tcp) can shrink")

    def __init__(self, transport: Transport, devices: DeviceMatrix, mode: str, transport_kind: str,
                 host: str, token: int, timeout: float, checks: Checks = Checks(False, None),
                 job: auth.Auth | None = None, lineage: grow.Lineage | None = None) -> None:
        self._transport = transport
        # The slots of the job's first group this group's ranks hold (None for a split()'s):
        # where grow() finds newcomers.
        self._lineage = lineage
        self._devices = devices
        self.mode = mode
        self.transport_kind = transport_kind
        self._host = host
        self._token = token
        self._job = job
        self._timeout = timeout
        self._splits = 0
        self._checks = checks
        self._busy = use.new_lock()  # the engine's when built: its fast path takes it too
        self._link = FrameExchange(transport, timeout, checks.verify, checks.stall_report_s, self.failure)
        # The mesh runs log-latency schedules where they win (scheduled.py); the ring mode has neighbours only.
        self._algorithms: ScheduledMesh | RingAlgorithms = (
            ScheduledMesh(MeshAlgorithms(self._link, transport.size, shared_link=transport_kind == "tcp"),
                          self._link, transport.size) if mode == MESH
            else RingAlgorithms(self._link, transport.size))
        self._local: SharedCollectives | None = None  # set by attach_shared_memory on one host

    def attach_shared_memory(self) -> None:
        """When every rank is on this host (and JACKLRING_LOCAL_TRANSPORT allows it), run the
        collectives over shared memory from now on; when the group spans hosts and some host has
        several of its ranks, in stages, on a leaders' mesh split from this group (local.py). A
        collective over the mesh: every rank of the group calls it once, right after forming; on
        failure the group is closed."""
        try:
            placement = local.attach(self.rank(), self.size(), self._gather_records, self._transport)
            if not placement.shared:
                return
            group, staging = placement.group, None
            if len(placement.hosts) > 1:
                group = None
                if not self._leaders_can_link([members[0] for members in placement.hosts]):
                    if placement.group is not None:
                        placement.group.close()
                    return
                staging = staged.form(self, placement, "mesh")
                log.debug("rank %d: JACCL collectives in stages over %d hosts", self.rank(), len(placement.hosts))
        except BaseException:
            self.close()
            raise
        self._local = SharedCollectives(group, staging, self._timeout, self.failure, self._busy, self._busy_error)
        self.fast = self._local.fast_path()

    def _leaders_can_link(self, leaders: list[int]) -> bool:
        """Whether the hosts' first ranks can form a group of their own: in RDMA ring mode only
        when their cables make a ring (the same answer on every rank: the device file's)."""
        if self.mode != RING or self.transport_kind != "rdma":
            return True
        missing = jaccl_config.missing_ring_links([[self._devices[a][b] for b in leaders] for a in leaders])
        if missing:
            log.debug("rank %d: the hosts' first ranks %s have no RDMA ring (missing %s): collectives "
                      "over the mesh", self.rank(), leaders, missing)
        return not missing

    @property
    def shared_memory(self) -> bool:
        """Whether this group's collectives run over same-host shared memory (all on this host)."""
        return self._local is not None and self._local.staging is None

    @property
    def staging(self) -> "staged.Staging | None":
        """The staged collectives of a group spanning hosts (None: not staged)."""
        return self._local.staging if self._local is not None else None

    # ---- as the leaders' mesh of a group spanning hosts (local/staged.py's Leaders) ----------

    def set_stage(self, op_code: int, detail: int) -> None:
        self._link.stage = stage_tag(op_code, detail)

    def notify_outer(self, culprit: int) -> None:
        notify = getattr(self._transport, "notify_outer", None)  # the TCP mesh; verbs has no notices
        if notify is not None:
            notify(culprit)

    def _gather_records(self, record: bytes) -> list[bytes]:
        """All-gather of one fixed-size record per rank over the mesh (shared memory's set-up)."""
        n, width = self.size(), len(record)
        out = np.empty(n * width, np.uint8)
        self.all_gather(np.frombuffer(record, np.uint8), out)
        return [out[q * width:(q + 1) * width].tobytes() for q in range(n)]

    def set_timeout(self, seconds: float) -> None:
        self._timeout = config.check_seconds(float(seconds), "timeout")
        self._link.set_timeout(self._timeout)
        if self._local is not None:
            self._local.timeout = self._timeout

    def rank(self) -> int:
        return self._transport.rank

    def size(self) -> int:
        return self._transport.size

    # Each operation is numbered (the "seq" in timeouts and stall reports).

    @contextlib.contextmanager
    def _one_thread(self, what: str) -> Iterator[None]:
        """One operation at a time per group. JACCL's frames carry per-peer sequence numbers over
        shared links, so two threads interleaving their frames would read each other's data:
        a second thread gets a clear error instead (the ring and MPI allow it; here each thread
        needs a group of its own, from split())."""
        if not self._busy.acquire(blocking=False):
            raise self._busy_error(what)
        try:
            self._link.op_seq += 1
            yield
        finally:
            self._busy.release()

    def _busy_error(self, what: str) -> DistributedError:
        return DistributedError(f"rank {self.rank()}: {what} was called while another thread runs an operation "
                                f"on the same JACCL group; JACCL groups take one operation at a time: give "
                                f"each thread its own group (group.split)")

    # The collectives go over shared memory when the group has it (local.py takes the lock itself).

    def all_reduce(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        if self._local is not None:
            return self._local.all_reduce(src, dst, op)
        with self._one_thread("all_reduce"):
            self._algorithms.all_reduce(src, dst, op)

    def all_gather(self, src: np.ndarray, dst: np.ndarray) -> None:
        if self._local is not None:
            return self._local.all_gather(src, dst)
        with self._one_thread("all_gather"):
            self._algorithms.all_gather(src, dst)

    def reduce_scatter(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        if self._local is not None:
            return self._local.reduce_scatter(src, dst, op)
        with self._one_thread("reduce_scatter"):
            self._algorithms.reduce_scatter(src, dst, op)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if self._local is not None:
            return self._local.broadcast(buf, root)
        with self._one_thread("broadcast"):
            self._algorithms.broadcast(buf, root)

    def barrier(self) -> None:
        if self._local is not None:
            return self._local.barrier()
        with self._one_thread("barrier"):
            self._algorithms.barrier()

    def send(self, buf: np.ndarray, dst: int) -> None:
        with self._one_thread("send"):
            self._algorithms.send(buf, dst)

    def recv(self, buf: np.ndarray, src: int) -> None:
        with self._one_thread("recv"):
            self._algorithms.recv(buf, src)

    def _all_gather_blobs(self, blob: bytes) -> list[bytes]:
        """Variable-length all-gather over this group (lengths first, then padded bytes)."""
        n = self.size()
        lengths = np.empty(n, np.int64)
        self.all_gather(np.array([len(blob)], np.int64), lengths)
        width = int(lengths.max())
        padded = np.zeros(width, np.uint8)
        padded[:len(blob)] = np.frombuffer(blob, np.uint8)
        everything = np.empty(n * width, np.uint8)
        self.all_gather(padded, everything)
        return [everything[i * width:i * width + int(lengths[i])].tobytes() for i in range(n)]

    def split(self, color: int, key: int) -> Backend:
        """Ranks with the same color form a new mesh (or ring), ordered by (key, rank): fresh
        connection details are exchanged over this group, like the ring backend's split."""
        me = self.rank()
        pairs = np.empty(2 * self.size(), np.int64)
        self.all_gather(np.array([color, key], np.int64), pairs)
        colors, keys = pairs[0::2], pairs[1::2]
        members = split_members(colors, keys, color)
        new_rank = members.index(me)
        self._splits += 1
        token = zlib.crc32(f"{self._token}:{self._splits}:{color}".encode())
        # A sub-group keeps the job secret; without one its key follows its own context.
        job = self._job if self._job is not None and self._job.secret else auth.job_auth(str(token).encode(), "JACCL")
        devices = [[self._devices[a][b] for b in members] for a in members]
        mode = self.mode
        if len(members) > 1 and mode == RING:
            missing = jaccl_config.missing_ring_links(devices)
            if missing and self.transport_kind == "rdma":
                raise ConfigError(f"rank {me}: split(color={color}) ranks {members} do not form a ring of "
                                  f"RDMA links (missing cells {missing} of the sub-matrix)")
        peers = ([p for p in range(len(members)) if p != new_rank] if mode == MESH
                 else sorted({(new_rank - 1) % len(members), (new_rank + 1) % len(members)} - {new_rank}))

        def exchange(blob: bytes) -> list[bytes]:
            everyone = self._all_gather_blobs(blob)
            return [everyone[m] for m in members]

        deadline = time.monotonic() + config.connect_timeout()
        if len(members) == 1:
            exchange(b"")   # every parent rank takes part in the same exchanges
            self._confirm_split(color, colors, keys, None)
            return SingletonBackend()
        try:
            transport = build_transport(self.transport_kind, new_rank, len(members), peers,
                                         devices[new_rank], self._host, exchange, token, deadline, job,
                                         watch=lambda: self._watch_split(color, colors, keys))
        except DistributedError as exc:
            # The parent is now out of step (the others are mid-exchange): close it so they raise
            # at once instead of waiting for their deadline.
            self.failure.mark(f"a split of this group failed: {exc}")
            mesh_rank = getattr(exc, "mesh_rank", None)  # by the sub-group's numbering: the parent's here
            if mesh_rank is not None and 0 <= mesh_rank < len(members):
                blaming(exc, members[mesh_rank])
            culprit = failure_of(exc).culprit
            # Tell the parent members whom this rank blames before its connections close, or the
            # ones waiting on it (the other sub-group's, in the closing barrier) blame it.
            notify = getattr(self._transport, "notify_failure", None)
            if notify is not None and culprit is not None and culprit != me:
                notify(blaming(PeerError("a split failed"), culprit))
            self._transport.close()
            text = str(exc) if str(exc).startswith(f"rank {me}:") else f"rank {me}: split(color={color}): {exc}"
            if culprit is not None and 0 <= culprit < self.size() and culprit != me:
                text += f" ({self._member_text(culprit, colors, keys)} by the parent group's numbering)"
            raise blaming(type(exc)(text), culprit) from None
        self._confirm_split(color, colors, keys, transport)
        sub = JacclBackend(transport, devices, mode, self.transport_kind, self._host, token, self._timeout,
                           self._checks, job)
        sub.attach_shared_memory()
        return sub

    def _member_text(self, p: int, colors: np.ndarray, keys: np.ndarray) -> str:
        same = split_members(colors, keys, colors[p])
        return f"parent rank {p} (rank {same.index(p)} of the sub-group of color {int(colors[p])})"

    def _ended_parent_peers(self) -> list[int]:
        closed_peers = getattr(self._transport, "closed_peers", None)
        return closed_peers() if closed_peers is not None else []

    def _watch_split(self, color: int, colors: np.ndarray, keys: np.ndarray) -> None:
        """Raise when a parent member's connection ended while the sub-groups form: every rank of
        the TCP mesh is connected to every other, so each sees a death directly."""
        verdicts = getattr(self._transport, "pending_notices", lambda: {})()
        for reporter, culprit in verdicts.items():  # a member that gave up said whom it blames
            self.failure.mark("a split of this group failed")
            raise blaming(PeerError(f"rank {self.rank()}: split(color={color}): "
                                    f"{self._member_text(culprit, colors, keys)} failed while the sub-groups "
                                    f"formed (reported by {self._member_text(reporter, colors, keys)})"), culprit)
        ended = self._ended_parent_peers()
        if ended:
            self.failure.mark("a split of this group failed")
            raise blaming(PeerError(f"rank {self.rank()}: split(color={color}): "
                                    f"{self._member_text(ended[0], colors, keys)} died while the sub-groups "
                                    f"formed (its connection closed)"), ended[0])

    def _confirm_split(self, color: int, colors: np.ndarray, keys: np.ndarray, transport) -> None:
        """A parent barrier: every new connection is ready everywhere before the new group is used.
        Its failure names the parent members whose connections ended, in both numberings."""
        try:
            self.barrier()
        except DistributedError as exc:
            if transport is not None:
                transport.close()
            gone = self._ended_parent_peers()
            ended = ", ".join(self._member_text(p, colors, keys) for p in gone)
            failure = failure_of(exc)
            culprit = failure.culprit
            relayed = culprit is not None and failure.peer is not None and culprit != failure.peer  # a notice named it
            raise blaming(PeerError(f"rank {self.rank()}: split(color={color}): the sub-groups did not form on "
                                    f"every rank ({'ended: ' + ended if ended else 'no connection ended'}): {exc}"),
                          culprit if relayed or not gone else gone[0]) from None
        except BaseException:
            if transport is not None:
                transport.close()
            raise

    def break_links(self, why: str) -> None:
        """Fail this group now: its mesh connections end (the peers, and an operation in flight
        on another thread, fail at once) and every later operation raises `why`; the mesh's
        listener stays open for shrink's agreement."""
        self.failure.mark(why)
        if self._local is not None:
            self._local.break_links()  # a shared-memory wait sleeps on the segment, not the links
        stop = getattr(self._transport, "break_links", None)
        if stop is not None:
            stop()

    def shrink(self, exclude: Sequence[int], min_size: int | None, timeout: float) -> Backend:
        """A mesh of the old members that are still alive (jaccl/shrink.py); the TCP mesh only."""
        listener = getattr(self._transport, "listener", None)
        if self.transport_kind != "tcp" or listener is None or self._job is None:
            raise DistributedError(f"rank {self.rank()}: this JACCL group runs on {self.transport_kind}, which "
                                   f"cannot shrink: {self.shrink_missing}. Restart the job without the failed "
                                   f"rank, or run it on the TCP mesh or the ring backend, which can")
        if self._transport.closed:
            raise DistributedError(f"rank {self.rank()}: this JACCL group was closed; it cannot shrink")
        seat = membership.Seat(self.rank(), list(self._transport.addresses), listener, self._job, self._token,
                               mesh_forming.PURPOSE_SHRINK)
        return shrink.shrink_mesh(self, seat, self._host, exclude, min_size, timeout)

    def grow(self, count: int | None, timeout: float) -> Backend:
        """The mesh of the members and newcomers that knocked at MLX_JACCL_COORDINATOR
        (jaccl/grow.py); the TCP mesh only, and not a split()'s group."""
        if self.transport_kind != "tcp" or self._job is None:
            raise DistributedError(f"rank {self.rank()}: this JACCL group runs on {self.transport_kind}, which "
                                   f"cannot grow: its RDMA queue pairs are created once, from the device file "
                                   f"(MLX_IBV_DEVICES), and creating them for newcomers is not written. Restart "
                                   f"the job, or run it on the TCP mesh (JACKLRING_JACCL_TRANSPORT=tcp) or the "
                                   f"ring backend, which can grow")
        if self._lineage is None:
            raise DistributedError(f"rank {self.rank()}: this JACCL group cannot take in newcomers: it was formed "
                                   f"by split() (a sub-group holds no slots of the job's first group for a "
                                   f"newcomer to take)")
        if self._transport.closed:
            raise DistributedError(f"rank {self.rank()}: this JACCL group was closed; it cannot grow")
        return grow.grow_mesh(self, self._lineage, self._host, self._timeout, count, timeout,
                              _grown_builder(self._timeout, self._checks))

    @staticmethod
    def grown(transport: Transport, lineage: grow.Lineage, mode: str, host: str, token: int, timeout: float,
              checks: Checks, job: auth.Auth) -> "JacclBackend":
        """A grown group on its mesh (the device file's rows and columns of its slots), with
        shared memory as at init. A collective of the new group; on failure it is closed."""
        new = JacclBackend(transport, lineage.devices(), mode, "tcp", host, token, timeout, checks, job, lineage)
        new.attach_shared_memory()
        return new

    def reformed(self, members: list[int], transport: Transport, token: int, job: auth.Auth) -> "JacclBackend":
        """The group of `members` (old ranks, in order) on a mesh formed for them (a shrink): this
        group's devices, mode and settings, and shared memory as at init (whose all-gather is also
        the new group's closing barrier). A collective of the new group; on failure it is closed."""
        devices = [[self._devices[a][b] for b in members] for a in members]
        new = JacclBackend(transport, devices, self.mode, self.transport_kind, self._host, token, self._timeout,
                           self._checks, job, self._lineage.keep(members) if self._lineage is not None else None)
        new.attach_shared_memory()
        return new

    def close(self) -> None:
        self.failure.mark("the group was closed")
        self._transport.close()
        shrinking.release(self)  # the seats of groups that did not form on the way to this one
        if self._local is not None:
            self._local.close()
