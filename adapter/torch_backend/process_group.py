"""JacklringProcessGroup: a torch.distributed ProcessGroup written in Python over an adapter Backend.

torch 2.13 lets Python subclass ProcessGroup (not c10d's Backend): the C++ code that calls
a process group (DDP's reducer, broadcast_coalesced, the coalescing manager) reaches the
methods below through pybind11 trampolines, and torch.distributed's Python functions call
them directly. Both the torch 2.13 names and the older ones are provided.

Argument errors raise in the caller; communication runs on the executors (executors.py) and
its errors surface from Work.wait() / the future, naming rank, group and operation.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..backends.base import Backend
from ..errors import DistributedError, PeerError
from ..group import DEFAULT_SHRINK_TIMEOUT_S
from . import cpp_backend, cpp_handles, dynamo, inline, ops, shrink
from .executors import Completer, Executor, PeerExecutors
from .inbox import Inbox
from .p2p import PointToPoint
from .torch_errors import wrap_error
from .work import JacklringWork

log = logging.getLogger("jacklring.torch")
cpp_handles.install()  # DDP join's forward-pass Work outlives its Python object (cpp_handles.py)

BACKEND_NAME = "jacklring"
_STOP_TIMEOUT_S = 5.0


def _as_list(tensors: Any) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


_SUM = dist.ReduceOp.SUM


def _op_name(opts: Any, default: str = "SUM") -> str:
    """The reduce op from an options object, a ReduceOp, or nothing."""
    if opts is None:
        return default
    op = getattr(opts, "reduceOp", opts)
    if op == _SUM:  # the common case, without reading the pybind enum's name (a few us)
        return "SUM"
    return ops.reduce_op_name(op)


def _root(opts: Any, attr: str = "rootRank") -> int:
    return int(getattr(opts, attr, opts if isinstance(opts, int) else 0))


class JacklringProcessGroup(PointToPoint, dist.ProcessGroup):
    """One torch process group; `comm` is the adapter Backend of exactly its ranks."""

    def __init__(self, store: Any, rank: int, size: int, comm: Backend, timeout_s: float,
                 group_id: str = "", rendezvous: str = "store") -> None:
        # Only the (rank, size) constructor builds the Python-overridable (trampoline) instance.
        super().__init__(rank, size)
        self._store = store
        if comm.rank() != rank or comm.size() != size:
            raise ValueError(f"jacklring: communicator is rank {comm.rank()} of {comm.size()}, "
                             f"torch asked for rank {rank} of {size}")
        self._rank = rank
        self._size = size
        self._comm = comm
        self._aux: Backend | None = None  # private communicator for p2p-based collectives
        self._timeout_s = timeout_s
        self._group_id = group_id
        self.rendezvous = rendezvous  # how the communicator was formed: "environment", "store", "single rank"
        tag = f"jacklring-r{rank}-{group_id or 'pg'}"
        self._completer = Completer(tag)
        self._collectives = Executor(f"{tag}-comm", self._completer, self._error)
        self._p2p = PeerExecutors(f"{tag}-p2p", self._completer, self._error)  # sends, one thread per peer
        self._inboxes: dict[int, Inbox] = {}  # recvs, matched by tag, one per peer
        self._closed = False
        self._close_lock = threading.Lock()
        self._monitored_barriers = 0  # how many this rank entered: the next one's tag
        self._lane = inline.Lane(comm, size, self._collectives.run_inline)  # the short path's view of this group

    # ---- identity ---------------------------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    @property
    def underlying_backend(self) -> str:
        """The adapter backend doing the work (ring, mpi, ...)."""
        return self._comm.name

    @property
    def timeout_s(self) -> float:
        """The per-operation deadline, in seconds."""
        return self._timeout_s

    def description(self) -> str:
        return (f"jacklring process group {self._group_id or '(default)'}: rank {self._rank} of {self._size} "
                f"over the {self._comm.name} backend "
                f"(from the {self.rendezvous}), per-op deadline {self._timeout_s:g} s")

    def __repr__(self) -> str:
        return f"<JacklringProcessGroup rank {self._rank} of {self._size} over {self._comm.name}>"

    # The C++ base keeps group name and description in its (c10d) backends, and a Python
    # process group has none: keep them here.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return getattr(self, "_group_name", self._group_id)

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "undefined")

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # ---- plumbing ---------------------------------------------------------------------------

    def _error(self, what: str, exc: BaseException) -> BaseException:
        return wrap_error(self._rank, self._group_id or "default", what, exc, self._timeout_s)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self._rank}: jacklring {what} on a process group that was shut down")

    def _collective(self, what: str, result: list[torch.Tensor], run, opts: Any = None) -> JacklringWork:
        """Queue the op, or run it at once on this thread when the caller waits for it anyway
        (torch's async_op=False sets opts.asyncOp False; C++ callers and async_op=True keep the
        default True) and nothing of this group is queued or running (docs/torch.md)."""
        self._check_open(what)
        inline = getattr(opts, "asyncOp", True) is False
        return self._collectives.submit(JacklringWork(what, result), run, inline=inline)

    def _aux_comm(self) -> Backend:
        """A second communicator of the same ranks, created collectively on first use (on the
        communication thread, so in the same order on every rank). Collectives built from
        send/recv use it, so they never interleave with user point-to-point messages."""
        if self._aux is None:
            self._aux = self._comm.split(0, self._rank)
        return self._aux

    @staticmethod
    def _check_tensors(what: str, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"jacklring {what}: expected tensors, got {type(t).__name__}")
            if t.is_sparse:
                raise ValueError(f"jacklring {what}: sparse tensors are not supported")

    # ---- all-reduce -------------------------------------------------------------------------

    def allreduce(self, tensors: Any, opts: Any = None) -> JacklringWork:
        if getattr(opts, "asyncOp", True) is False and type(tensors) is list and len(tensors) == 1 and not self._closed:
            work = inline.all_reduce(self._lane, tensors, opts)
            if work is not None:
                return work
        tensors = _as_list(tensors)
        name = _op_name(opts)
        if any(isinstance(t, torch.Tensor) and t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, name, opts)
        self._check_tensors("allreduce", tensors)
        for t in tensors:
            ops.check_reduce_op(name, t)
        return self._collective(f"allreduce({name})", tensors,
                                lambda: ops.all_reduce(self._comm, tensors, name), opts)

    def _sparse_allreduce(self, tensors: list[torch.Tensor], name: str, opts: Any = None) -> JacklringWork:
        if name != "SUM":
            raise ValueError(f"jacklring allreduce: sparse tensors support ReduceOp.SUM only (as gloo), not {name}")
        for t in tensors:
            if not t.is_sparse:
                raise ValueError("jacklring allreduce: cannot mix sparse and dense tensors in one call")

        def run() -> None:
            for t in tensors:
                ops.sparse_all_reduce(self._comm, t)
        return self._collective("allreduce(SUM, sparse)", tensors, run, opts)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> JacklringWork:
        tensors = _as_list(tensors)
        name = _op_name(opts)
        self._check_tensors("allreduce_coalesced", tensors)
        for t in tensors:
            ops.check_reduce_op(name, t)
        return self._collective(f"allreduce_coalesced({name})", tensors,
                                lambda: ops.all_reduce_coalesced(self._comm, tensors, name), opts)

    def reduce(self, tensors: Any, opts: Any = None) -> JacklringWork:
        tensors = _as_list(tensors)
        name, root = _op_name(opts), _root(opts)
        self._check_root("reduce", root)
        ops.check_reduce_op(name, tensors[0])
        return self._collective(f"reduce({name}, root {root})", tensors,
                                lambda: ops.reduce(self._comm, tensors[0], root, name), opts)

    # ---- reduce-scatter ---------------------------------------------------------------------

    def reduce_scatter(self, outputs: Any, input_lists: Any, opts: Any = None) -> JacklringWork:
        outputs = _as_list(outputs)
        if input_lists and isinstance(input_lists[0], torch.Tensor):
            input_lists = [input_lists]
        name = _op_name(opts)
        ops.check_reduce_op(name, outputs[0])

        def run() -> None:
            for out, inputs in zip(outputs, input_lists):
                ops.reduce_scatter_list(self._comm, out, inputs, name)
        return self._collective(f"reduce_scatter({name})", outputs, run, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> JacklringWork:
        if getattr(opts, "asyncOp", True) is False and not self._closed:
            work = inline.reduce_scatter_tensor(self._lane, output, input, opts)
            if work is not None:
                return work
        name = _op_name(opts)
        ops.check_reduce_op(name, output)
        self._check_multiple("reduce_scatter_tensor", input.numel(), output.numel())
        return self._collective(f"reduce_scatter_tensor({name})", [output],
                                lambda: ops.reduce_scatter_flat(self._comm, output, input, name), opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                                        opts: Any = None) -> JacklringWork:
        outputs, inputs = list(outputs), list(inputs)
        name = _op_name(opts)
        for out, inp in zip(outputs, inputs):
            ops.check_reduce_op(name, out)
            self._check_multiple("reduce_scatter_tensor_coalesced", inp.numel(), out.numel())

        def run() -> None:
            for out, inp in zip(outputs, inputs):
                ops.reduce_scatter_flat(self._comm, out, inp, name)
        return self._collective(f"reduce_scatter_tensor_coalesced({name})", outputs, run, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---- all-gather -------------------------------------------------------------------------

    def allgather(self, output_lists: Any, inputs: Any, opts: Any = None) -> JacklringWork:
        inputs = _as_list(inputs)
        if output_lists and isinstance(output_lists[0], torch.Tensor):
            output_lists = [output_lists]
        if len(output_lists) != len(inputs):
            raise ValueError(f"jacklring allgather: {len(output_lists)} output lists for {len(inputs)} inputs")

        def run() -> None:
            for outs, inp in zip(output_lists, inputs):
                ops.all_gather_list(self._comm, outs, inp)
        return self._collective("allgather", [t for outs in output_lists for t in outs], run, opts)

    def allgather_coalesced(self, output_lists: Any, inputs: Any, opts: Any = None) -> JacklringWork:
        """output_lists[q][i] = rank q's inputs[i] (the old all_gather_coalesced layout)."""
        inputs = _as_list(inputs)
        if len(output_lists) != self._size:
            raise ValueError(f"jacklring allgather_coalesced: expected {self._size} output lists, got "
                             f"{len(output_lists)}")

        def run() -> None:
            for i, inp in enumerate(inputs):
                ops.all_gather_list(self._comm, [output_lists[q][i] for q in range(self._size)], inp)
        return self._collective("allgather_coalesced", [t for outs in output_lists for t in outs], run, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> JacklringWork:
        if getattr(opts, "asyncOp", True) is False and not self._closed:
            work = inline.all_gather_into_tensor(self._lane, output, input)
            if work is not None:
                return work
        self._check_multiple("all_gather_into_tensor", output.numel(), input.numel())
        return self._collective("all_gather_into_tensor", [output],
                                lambda: ops.all_gather_flat(self._comm, output, input), opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                                    opts: Any = None) -> JacklringWork:
        outputs, inputs = list(outputs), list(inputs)
        for out, inp in zip(outputs, inputs):
            self._check_multiple("all_gather_into_tensor_coalesced", out.numel(), inp.numel())

        def run() -> None:
            for out, inp in zip(outputs, inputs):
                ops.all_gather_flat(self._comm, out, inp)
        return self._collective("all_gather_into_tensor_coalesced", outputs, run, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # ---- rooted and personalised ------------------------------------------------------------

    def broadcast(self, tensors: Any, opts: Any = None) -> JacklringWork:
        if getattr(opts, "asyncOp", True) is False and type(tensors) is list and len(tensors) == 1 and not self._closed:
            work = inline.broadcast(self._lane, tensors, opts)
            if work is not None:
                return work
        tensors = _as_list(tensors)
        root = _root(opts)
        self._check_root("broadcast", root)

        def run() -> None:
            for t in tensors:  # on CPU torch passes one tensor per rank
                ops.broadcast(self._comm, t, root)
        return self._collective(f"broadcast(root {root})", tensors, run, opts)

    def gather(self, output_lists: Any, inputs: Any, opts: Any = None) -> JacklringWork:
        inputs = _as_list(inputs)
        root = _root(opts)
        self._check_root("gather", root)
        outputs = None
        if self._rank == root:
            if not output_lists or len(output_lists[0]) != self._size:
                raise ValueError(f"jacklring gather: the root needs a list of {self._size} output tensors")
            outputs = list(output_lists[0])
            for q, t in enumerate(outputs):
                if t.numel() != inputs[0].numel() or t.dtype != inputs[0].dtype:
                    raise ValueError(f"jacklring gather: output tensor {q} ({t.dtype}, {t.numel()} elements) does "
                                     f"not match the input ({inputs[0].dtype}, {inputs[0].numel()} elements)")
        result = outputs if outputs is not None else []
        return self._collective(f"gather(root {root})", result,
                                lambda: ops.gather(self._aux_comm(), outputs, inputs[0], root), opts)

    def scatter(self, outputs: Any, input_lists: Any, opts: Any = None) -> JacklringWork:
        outputs = _as_list(outputs)
        root = _root(opts)
        self._check_root("scatter", root)
        inputs = None
        if self._rank == root:
            if not input_lists or len(input_lists[0]) != self._size:
                raise ValueError(f"jacklring scatter: the root needs a list of {self._size} input tensors")
            inputs = list(input_lists[0])
            for q, t in enumerate(inputs):
                if t.numel() != outputs[0].numel() or t.dtype != outputs[0].dtype:
                    raise ValueError(f"jacklring scatter: input tensor {q} ({t.dtype}, {t.numel()} elements) does "
                                     f"not match the output ({outputs[0].dtype}, {outputs[0].numel()} elements)")
        return self._collective(f"scatter(root {root})", outputs,
                                lambda: ops.scatter(self._aux_comm(), outputs[0], inputs, root), opts)

    def alltoall(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                 opts: Any = None) -> JacklringWork:
        outputs, inputs = list(outputs), list(inputs)
        if len(outputs) != self._size or len(inputs) != self._size:
            raise ValueError(f"jacklring all_to_all: expected {self._size} input and output tensors, got "
                             f"{len(inputs)} and {len(outputs)}")
        return self._collective("all_to_all", outputs,
                                lambda: ops.all_to_all(self._aux_comm(), outputs, inputs), opts)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int] = (),
                          input_splits: Sequence[int] = (), opts: Any = None) -> JacklringWork:
        outs = ops.split_dim0(output, list(output_splits or ()), self._size, "output")
        ins = ops.split_dim0(input, list(input_splits or ()), self._size, "input")
        return self._collective("all_to_all_single", [output],
                                lambda: ops.all_to_all(self._aux_comm(), outs, ins), opts)

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> JacklringWork:
        if getattr(opts, "asyncOp", True) is False and not self._closed:
            work = inline.barrier(self._lane)
            if work is not None:
                return work
        return self._collective("barrier", [], self._comm.barrier, opts)

    # ---- the C++ Backend's calls (cpp_backend.py, csrc/torch/backend.cpp) --------------------

    def shared_memory(self) -> Any:
        """The shared-memory segment of the whole group when its communicator has one (a ring
        whose ranks are all on this host), else None."""
        probe = getattr(self._comm, "whole_group_segment", None)
        return probe() if callable(probe) and not self._closed else None

    def wait_collectives_idle(self) -> None:
        """Return once no collective of this group is queued or running (the C++ Backend calls
        this before a native op that follows ops it handed over: issue order)."""
        try:
            self._collectives.wait_idle(self._timeout_s)
        except TimeoutError as exc:
            raise self._error("a native collective waiting for the earlier ones", exc) from None

    def native_failure(self, name: str, status: tuple, header: bytes) -> None:
        """Raise what this group raises for the engine's status (the one conversion place,
        local/engine.py), named as the Python path names the op (`name`, e.g. allreduce(SUM))."""
        from ..backends.local import engine

        segment = self.shared_memory()
        if segment is None:
            raise self._error(name, DistributedError(f"the shared-memory engine failed (status {status[0]})"))
        segment.what = name
        try:
            engine.raise_status(segment, tuple(status), header)
        except Exception as exc:
            # As the Python path says (ring/plumbing.py): another thread gave the group up while
            # this op ran (dist.shrink_group's SHRINK_ABORT): why, not just what broke.
            earlier = getattr(getattr(self._comm, "failure", None), "why", None)
            if earlier is not None and isinstance(exc, DistributedError):
                exc = PeerError(f"{exc}; {earlier}")
            raise self._error(name, exc)  # noqa: B904  (wrap_error chains exc as the cause)

    # ---- lifecycle --------------------------------------------------------------------------

    supports_shrinking = True  # dist.shrink_group works on these groups (shrink.py)

    def shrunk(self, excluded: Sequence[int], store: Any, group_id: str) -> "JacklringProcessGroup":
        """A process group of this group's ranks minus `excluded`, formed by the communicator's
        shrink() on every remaining rank (dist.shrink_group registers it with torch). A rank
        found dead or too slow beyond `excluded` fails it on every survivor: torch's ranks of
        the new group would not match."""
        self._check_open("shrink_group")
        comm = self._comm.shrink(list(excluded), None, min(self._timeout_s, DEFAULT_SHRINK_TIMEOUT_S))
        expected = self._size - len(excluded)
        if comm.size() != expected:
            comm.close()
            raise DistributedError(f"rank {self._rank}: shrink_group({list(excluded)}): only {comm.size()} ranks "
                                   f"formed the new group, {expected} expected: another rank is gone too; "
                                   f"call shrink_group with every failed rank in ranks_to_exclude")
        return JacklringProcessGroup(store, comm.rank(), comm.size(), comm, self._timeout_s, group_id=group_id,
                                     rendezvous=f"shrink of {self.rendezvous}")

    def shutdown(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._collectives.stop(_STOP_TIMEOUT_S)
        self._p2p.stop(_STOP_TIMEOUT_S)
        for inbox in list(self._inboxes.values()):
            inbox.stop()
        self._completer.stop(_STOP_TIMEOUT_S)
        for comm in (self._aux, self._comm):
            if comm is not None:
                try:
                    comm.close()
                except Exception as exc:  # closing a broken communicator must not mask the real error
                    log.debug("rank %d: closing %r: %s", self._rank, comm, exc)
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for inbox in list(self._inboxes.values()):  # their reads end with the closed connections
            inbox.join(max(0.0, deadline - time.monotonic()))

    def abort(self) -> None:
        self.shutdown()

    # ---- argument checks --------------------------------------------------------------------

    def _check_root(self, what: str, root: int) -> None:
        if not 0 <= root < self._size:
            raise ValueError(f"jacklring {what}: root {root} is out of range for a group of {self._size}")

    def _check_multiple(self, what: str, big: int, small: int) -> None:
        if big != small * self._size:
            raise ValueError(f"jacklring {what}: the larger tensor has {big} elements, expected "
                             f"{self._size} x {small} (world size x smaller tensor)")


# The operations torch calls on a process group, opaque to Dynamo (dynamo.py).
_OPERATIONS = (
    "allreduce", "allreduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
    "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "allgather", "allgather_coalesced",
    "all_gather_single", "_allgather_base", "all_gather_single_coalesced", "allgather_into_tensor_coalesced",
    "broadcast", "gather", "scatter", "alltoall", "all_to_all_single", "alltoall_base", "barrier",
    "monitored_barrier", "send", "recv", "recv_anysource", "shutdown", "abort",
)
dynamo.make_opaque(JacklringProcessGroup, _OPERATIONS)
# dist.shrink_group on these groups (shrink.py)
shrink.install(JacklringProcessGroup, lambda pg: cpp_backend.python_group(pg, JacklringProcessGroup))
