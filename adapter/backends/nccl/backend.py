"""The NCCL backend over cupy.cuda.nccl: collectives between CUDA devices.

Environment (as MLX): MLX_RANK, MLX_WORLD_SIZE, NCCL_HOST_IP and NCCL_PORT (where rank 0
serves the NCCL unique id, see bootstrap.py), CUDA_VISIBLE_DEVICES. Each rank uses one
device: JACKLRING_CUDA_DEVICE, else local rank modulo the visible device count.

Two kinds of buffers, in every method of the Backend interface:
  - numpy arrays (the interface's contract): copied to the device, reduced by NCCL, copied
    back. Correct everywhere, and what CPU-side callers get.
  - DeviceBuffer (adapter.backends.base): memory already on this rank's device, a
    cupy array or CUDA torch tensor described by adapter.gpu.device_buffer(). NCCL reads and
    writes it in place on the caller's stream: no copies. `takes_device_buffers = True`
    tells the ops layer and the torch process group to use this path.
src and dst of one call are both numpy or both DeviceBuffer.

Every call waits for its work to finish before returning, polling with the per-operation
deadline (JACKLRING_TIMEOUT): a dead peer becomes CollectiveTimeout naming the rank and the
operation, the communicator is aborted, and later calls raise at once instead of hanging.

cupy is imported only when a communicator is created.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

import numpy as np

from ... import config
from ...config import connect_timeout as default_connect_timeout
from ...config import env_rank, op_timeout
from ...errors import CollectiveTimeout, ConfigError, DistributedError, PeerError
from ..base import Backend, DeviceBuffer, ReduceOp
from ..transport import tcp
from . import bootstrap as nccl_bootstrap
from .device import choose_device, device_count
from .environment import probe  # noqa: F401  (part of this module's interface)
from .types import NCCL_INT32, NCCL_SUM, NCCL_UINT8, ReducePlan, reduce_plan

log = logging.getLogger("jacklring.nccl")

# ncclCommSplit arrived in NCCL 2.18.1; older libraries split by bootstrapping over the parent.
COMM_SPLIT_VERSION = 21801
_SPIN_POLLS = 200
_MAX_SLEEP_S = 0.001


def world_from_env() -> tuple[int, int, str, int]:
    """(rank, world size, host, port) from the environment, with errors naming the variable."""
    raw = os.environ.get("MLX_WORLD_SIZE", "")
    try:
        world = int(raw)
    except ValueError:
        raise ConfigError(f"MLX_WORLD_SIZE={raw!r} is not an integer") from None
    if world < 1:
        raise ConfigError(f"MLX_WORLD_SIZE={world} must be at least 1")
    rank = env_rank(world)
    host = os.environ.get("NCCL_HOST_IP", "")
    port_text = os.environ.get("NCCL_PORT", "")
    host, port = tcp.parse_address(f"{host}:{port_text}", "NCCL_HOST_IP:NCCL_PORT")
    return rank, world, host, port


def create(timeout: float | None = None) -> "NcclBackend":
    rank, world, host, port = world_from_env()
    count = device_count()
    device = choose_device(rank, count)
    return NcclBackend.connect(rank, world, host, port, device, timeout=timeout)


def _cupy():
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as exc:
        raise DistributedError(f"the NCCL backend needs cupy with NCCL ({exc}); "
                               f"pip install 'jacklring[nccl]'") from None
    if not nccl.available:
        raise DistributedError("cupy is installed but cannot load libnccl (pip install nvidia-nccl-cu12)")
    return cupy, nccl


def _make_unique_id() -> bytes:
    _, nccl = _cupy()
    return nccl_bootstrap.id_to_bytes(nccl.get_unique_id())


def _within(fn: Callable[[], Any], seconds: float, what: str) -> Any:
    """fn() on a helper thread, or PeerError after `seconds`: a blocking NCCL call (communicator
    creation, split) cannot be interrupted, so a rank that never arrives must not hang this one."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            result["error"] = exc

    thread = threading.Thread(target=run, name=f"jacklring-nccl-{what}", daemon=True)
    thread.start()
    thread.join(max(0.0, seconds))
    if thread.is_alive():
        raise PeerError(f"{what} did not finish within {seconds:.0f} s: a rank never joined "
                        f"(it died, or runs another collective)")
    if "error" in result:
        raise _wrap(result["error"], what)
    return result["value"]


def _wrap(exc: BaseException, what: str) -> BaseException:
    if isinstance(exc, DistributedError):
        return exc
    return PeerError(f"{what} failed: {type(exc).__name__}: {exc}")


class NcclBackend(Backend):
    name = "nccl"
    shrink_missing = ("that needs ncclCommShrink (NCCL 2.27+), which this backend does not expose yet")
    takes_device_buffers = True

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def connect(cls, rank: int, size: int, host: str, port: int, device: int,
                timeout: float | None = None, connect_timeout: float | None = None) -> "NcclBackend":
        """Exchange the unique id through rank 0 at host:port, then form the communicator."""
        limit = default_connect_timeout(connect_timeout)
        started = time.monotonic()
        unique_id = nccl_bootstrap.exchange_id(rank, size, host, port, _make_unique_id, limit)
        remaining = max(1.0, limit - (time.monotonic() - started))
        return cls.from_unique_id(rank, size, unique_id, device, timeout, remaining)

    @classmethod
    def from_unique_id(cls, rank: int, size: int, unique_id: bytes, device: int,
                       timeout: float | None = None, connect_timeout: float | None = None) -> "NcclBackend":
        """ncclCommInitRank on `device` (blocks until all `size` ranks call it, within the deadline)."""
        cupy, nccl = _cupy()
        limit = default_connect_timeout(connect_timeout)

        def build():
            with cupy.cuda.Device(device):
                try:
                    return nccl.NcclCommunicator(size, unique_id, rank)
                except TypeError:  # cupy < 13 takes the id as a tuple of signed chars
                    return nccl.NcclCommunicator(size, nccl_bootstrap.id_as_tuple(unique_id), rank)

        comm = _within(build, limit, f"rank {rank}: creating the NCCL communicator of {size} ranks on cuda:{device}")
        return cls(comm, rank, size, device, timeout, limit)

    def __init__(self, comm, rank: int, size: int, device: int, timeout: float | None,
                 connect_timeout: float | None = None) -> None:
        cupy, nccl = _cupy()
        self._cp, self._nccl = cupy, nccl
        self._comm = comm
        self._rank, self._size, self.device = rank, size, device
        self.timeout = op_timeout(timeout)
        self._connect_timeout = default_connect_timeout(connect_timeout)
        self._closed = False
        self._lock = threading.Lock()
        self._streams: dict[int, Any] = {}
        with cupy.cuda.Device(device):
            self._stream = cupy.cuda.Stream(non_blocking=True)  # for host (numpy) buffers
            self._token = cupy.zeros(1, dtype=np.int32)          # barrier payload

    # ---- Backend interface ----------------------------------------------------------------

    def set_timeout(self, seconds: float) -> None:
        self.timeout = config.check_seconds(float(seconds), "timeout")

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def all_reduce(self, src, dst, op: ReduceOp) -> None:
        plan = reduce_plan(src.dtype, op)
        self._check_pair(src, dst, src_count=_count(dst), what="all_reduce")
        self._reduce("all_reduce", plan, src, dst, lambda comm, s, d, n, dt, o, st: comm.allReduce(s, d, n, dt, o, st))

    def reduce_scatter(self, src, dst, op: ReduceOp) -> None:
        plan = reduce_plan(src.dtype, op)
        self._check_pair(src, dst, src_count=_count(dst) * self._size, what="reduce_scatter")
        self._reduce("reduce_scatter", plan, src, dst,
                     lambda comm, s, d, n, dt, o, st: comm.reduceScatter(s, d, n, dt, o, st))

    def all_gather(self, src, dst) -> None:
        self._check_pair(src, dst, src_count=_count(dst) // self._size, what="all_gather")
        if _count(dst) != _count(src) * self._size:
            raise ValueError(f"rank {self._rank}: all_gather needs dst of {self._size} x {_count(src)} elements, "
                             f"got {_count(dst)}")

        def body(s: DeviceBuffer, d: DeviceBuffer, stream: int) -> None:
            self._comm.allGather(s.ptr, d.ptr, s.nbytes, NCCL_UINT8, stream)

        self._run("all_gather", src, dst, body)

    def broadcast(self, buf, root: int) -> None:
        if not 0 <= root < self._size:
            raise ValueError(f"rank {self._rank}: broadcast root {root} is out of range for {self._size} ranks")

        def body(b: DeviceBuffer, _d: DeviceBuffer, stream: int) -> None:
            self._comm.bcast(b.ptr, b.nbytes, NCCL_UINT8, root, stream)

        self._run(f"broadcast(root {root})", buf, buf, body)

    def barrier(self) -> None:
        token = self._token
        buf = DeviceBuffer(token.data.ptr, 1, np.dtype(np.int32), self.device, self._stream.ptr, token)

        def body(b: DeviceBuffer, _d: DeviceBuffer, stream: int) -> None:
            self._comm.allReduce(b.ptr, b.ptr, 1, NCCL_INT32, NCCL_SUM, stream)

        self._run("barrier", buf, buf, body)

    def send(self, buf, dst: int) -> None:
        self._check_peer(dst, "send to")

        def body(b: DeviceBuffer, _d: DeviceBuffer, stream: int) -> None:
            self._nccl.groupStart()
            try:
                self._comm.send(b.ptr, b.nbytes, NCCL_UINT8, dst, stream)
            finally:
                self._nccl.groupEnd()

        self._run(f"send to rank {dst}", buf, None, body)

    def recv(self, buf, src: int) -> None:
        self._check_peer(src, "recv from")

        def body(_s: DeviceBuffer, b: DeviceBuffer, stream: int) -> None:
            self._nccl.groupStart()
            try:
                self._comm.recv(b.ptr, b.nbytes, NCCL_UINT8, src, stream)
            finally:
                self._nccl.groupEnd()

        self._run(f"recv from rank {src}", None, buf, body)

    def sendrecv(self, send_buf, dst: int, recv_buf, src: int) -> None:
        """Send send_buf to dst and receive recv_buf from src as one NCCL group, so two ranks
        can exchange (or a pipeline can shift) without ordering their sends (beyond MLX).
        dst and src may be this rank itself."""
        for peer, what in ((dst, "send to"), (src, "recv from")):
            if not 0 <= peer < self._size:
                raise ValueError(f"rank {self._rank}: cannot {what} rank {peer} in a group of {self._size}")
        if isinstance(send_buf, DeviceBuffer) != isinstance(recv_buf, DeviceBuffer):
            raise TypeError(f"rank {self._rank}: sendrecv needs both buffers numpy or both DeviceBuffer")

        def body(s: DeviceBuffer, r: DeviceBuffer, stream: int) -> None:
            self._nccl.groupStart()
            try:
                self._comm.send(s.ptr, s.nbytes, NCCL_UINT8, dst, stream)
                self._comm.recv(r.ptr, r.nbytes, NCCL_UINT8, src, stream)
            finally:
                self._nccl.groupEnd()

        self._run(f"sendrecv(to rank {dst}, from rank {src})", send_buf, recv_buf, body)

    def split(self, color: int, key: int) -> "NcclBackend":
        """ncclCommSplit where the library has it (NCCL >= 2.18.1), else a new communicator
        whose unique id each group's first member creates and hands out over this one."""
        self._check_usable("split")
        if color < 0:
            raise ValueError(f"rank {self._rank}: split color must be >= 0, got {color}")
        what = f"rank {self._rank}: split(color {color}, key {key})"
        if hasattr(self._comm, "commSplit") and self._nccl.get_version() >= COMM_SPLIT_VERSION \
                and config.get("JACKLRING_NCCL_SPLIT") != "bootstrap":
            def build():
                with self._cp.cuda.Device(self.device):
                    return self._comm.commSplit(color, key)
            comm = _within(build, self._connect_timeout, what)
            return NcclBackend(comm, comm.rank_id(), comm.size(), self.device, self.timeout, self._connect_timeout)
        return self._split_by_bootstrap(color, key)

    def _split_by_bootstrap(self, color: int, key: int) -> "NcclBackend":
        mine = np.array([color, key], dtype=np.int64)
        every = np.empty(2 * self._size, dtype=np.int64)
        self.all_gather(mine, every)
        records = [(int(every[2 * r]), int(every[2 * r + 1])) for r in range(self._size)]
        members, new_rank = nccl_bootstrap.plan_split(records, self._rank)
        leader_id = _make_unique_id() if new_rank == 0 else b""
        slot = np.zeros(nccl_bootstrap.MAX_SPLIT_ID_BYTES, dtype=np.uint8)
        slot[:len(leader_id)] = np.frombuffer(leader_id, dtype=np.uint8)
        ids = np.empty(self._size * slot.size, dtype=np.uint8)
        self.all_gather(slot, ids)
        leader = members[0]
        unique_id = ids[leader * slot.size:(leader + 1) * slot.size].tobytes()[:nccl_bootstrap.NCCL_ID_BYTES]
        return NcclBackend.from_unique_id(new_rank, len(members), unique_id, self.device,
                                          self.timeout, self._connect_timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.failure.why is None:
                self._comm.destroy()
            else:
                self._comm.abort()
        except Exception as exc:  # noqa: BLE001 - closing must not raise over the real error
            log.warning("rank %d: closing the NCCL communicator: %s", self._rank, exc)

    # ---- machinery ------------------------------------------------------------------------

    def _check_usable(self, what: str) -> None:
        self.failure.check()  # after an abort (which also closes): unusable, and why
        if self._closed:
            raise DistributedError(f"rank {self._rank}: {what} on a closed NCCL communicator")

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self._size or peer == self._rank:
            raise ValueError(f"rank {self._rank}: cannot {what} rank {peer} in a group of {self._size}")

    def _check_pair(self, src, dst, src_count: int, what: str) -> None:
        if isinstance(src, DeviceBuffer) != isinstance(dst, DeviceBuffer):
            raise TypeError(f"rank {self._rank}: {what} needs src and dst both numpy or both DeviceBuffer")
        if np.dtype(src.dtype) != np.dtype(dst.dtype):
            raise TypeError(f"rank {self._rank}: {what} src dtype {src.dtype} differs from dst dtype {dst.dtype}")
        if _count(src) != src_count:
            raise ValueError(f"rank {self._rank}: {what} got {_count(src)} source elements for "
                             f"{_count(dst)} destination elements in a group of {self._size}")

    def _reduce(self, what: str, plan: ReducePlan, src, dst, call) -> None:
        """A reduction following `plan`: widened on the device first when NCCL lacks the dtype."""
        def body(s: DeviceBuffer, d: DeviceBuffer, stream: int) -> None:
            if plan.widen_to is None:
                n = d.count * plan.per_element
                call(self._comm, s.ptr, d.ptr, n, plan.nccl_dtype, plan.nccl_op, stream)
                return
            cp = self._cp
            with self._stream_object(stream):
                wide_src = self._view(s).astype(plan.widen_to)
                wide_dst = cp.empty(d.count, dtype=plan.widen_to)
                call(self._comm, wide_src.data.ptr, wide_dst.data.ptr, d.count, plan.nccl_dtype, plan.nccl_op, stream)
                self._view(d)[...] = wide_dst.astype(d.dtype)

        self._run(f"{what}({plan_name(plan)})", src, dst, body)

    def _view(self, buf: DeviceBuffer):
        """A 1-D cupy array over a DeviceBuffer's memory (no copy)."""
        cp = self._cp
        mem = cp.cuda.UnownedMemory(buf.ptr, buf.nbytes, buf.owner, self.device)
        return cp.ndarray((buf.count,), dtype=buf.dtype, memptr=cp.cuda.MemoryPointer(mem, 0))

    def _run(self, what: str, src, dst, body: Callable[[DeviceBuffer, DeviceBuffer, int], None]) -> None:
        """Stage host buffers to the device if needed, enqueue body, wait for it under the deadline."""
        self._check_usable(what)
        with self._lock, self._cp.cuda.Device(self.device):
            deadline = time.monotonic() + self.timeout
            host = isinstance(src, np.ndarray) or isinstance(dst, np.ndarray)
            stream = self._stream.ptr if host else (src if src is not None else dst).stream
            for b in (src, dst):
                if isinstance(b, DeviceBuffer) and b.device != self.device:
                    raise ValueError(f"rank {self._rank}: {what} got a buffer on cuda:{b.device}, but this "
                                     f"communicator uses cuda:{self.device}")
            try:
                d_src = self._to_device(src) if host and src is not None else src
                if host and dst is not None:
                    d_dst = d_src if dst is src else self._device_scratch(dst)
                else:
                    d_dst = dst
                body(d_src, d_dst, stream)
                # Wait before the copy back: a device-to-host copy into pageable memory blocks
                # the thread until the stream gets there, which would bypass the deadline.
                self._wait(stream, what, deadline)
                if host and dst is not None and dst.nbytes:
                    d_dst.owner.copy_to_host_async(dst.ctypes.data, dst.nbytes, self._stream)
                    self._stream.synchronize()
            except DistributedError:
                raise
            except Exception as exc:  # noqa: BLE001 - NcclError / CUDA errors: name rank and op
                self.failure.mark(f"{what}: {exc}")
                self._abort()
                raise PeerError(f"rank {self._rank}: NCCL {what} failed: {exc}") from None

    def _to_device(self, arr: np.ndarray) -> DeviceBuffer:
        """A device copy of a host buffer, on the host-path stream (cupy's pool caches the memory)."""
        mem = self._cp.cuda.alloc(max(arr.nbytes, 1))
        if arr.nbytes:
            mem.copy_from_host_async(np.ascontiguousarray(arr).ctypes.data, arr.nbytes, self._stream)
        return DeviceBuffer(mem.ptr, arr.size, arr.dtype, self.device, self._stream.ptr, mem)

    def _device_scratch(self, arr: np.ndarray) -> DeviceBuffer:
        mem = self._cp.cuda.alloc(max(arr.nbytes, 1))
        return DeviceBuffer(mem.ptr, arr.size, arr.dtype, self.device, self._stream.ptr, mem)

    def _stream_object(self, ptr: int):
        """A cupy Stream for a raw handle (0: the legacy default stream torch uses by default)."""
        if ptr == self._stream.ptr:
            return self._stream
        if ptr == 0:
            return self._cp.cuda.Stream.null
        cached = self._streams.get(ptr)
        if cached is None:
            stream_cls = self._cp.cuda.Stream
            if hasattr(stream_cls, "from_external"):
                cached = stream_cls.from_external(_RawStream(ptr))
            else:  # cupy < 14
                cached = self._cp.cuda.ExternalStream(ptr, self.device)
            self._streams[ptr] = cached
        return cached

    def _wait(self, stream: int, what: str, deadline: float) -> None:
        """Poll until the stream passes this point, checking NCCL's asynchronous errors."""
        cp = self._cp
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record(self._stream_object(stream))
        polls = 0
        sleep = 1e-5
        while not event.done:
            self._comm.check_async_error()
            if time.monotonic() > deadline:
                self.failure.mark(f"{what} timed out")
                self._abort()
                raise CollectiveTimeout(
                    f"rank {self._rank}: NCCL {what} did not finish within {self.timeout:.0f} s "
                    f"(JACKLRING_TIMEOUT); a peer died or is running a different collective. "
                    f"The communicator was aborted.")
            polls += 1
            if polls > _SPIN_POLLS:
                time.sleep(sleep)
                sleep = min(sleep * 2, _MAX_SLEEP_S)

    def _abort(self) -> None:
        try:
            self._comm.abort()
        except Exception as exc:  # noqa: BLE001
            log.warning("rank %d: ncclCommAbort failed: %s", self._rank, exc)
        self._closed = True


class _RawStream:
    """A raw CUDA stream handle behind the CUDA stream protocol (for cupy.cuda.Stream.from_external)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def _count(buf) -> int:
    return buf.count if isinstance(buf, DeviceBuffer) else int(buf.size)


def plan_name(plan: ReducePlan) -> str:
    from .types import nccl_dtype_name

    ops = {0: "sum", 1: "prod", 2: "max", 3: "min"}
    return f"{ops.get(plan.nccl_op, plan.nccl_op)}, {nccl_dtype_name(plan.nccl_dtype)}"

