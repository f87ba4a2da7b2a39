"""The short path of a synchronous collective on plain CPU tensors (docs/torch.md, "Inline").

`dist.all_reduce(t)`, `dist.broadcast`, `dist.all_gather_into_tensor`,
`dist.reduce_scatter_tensor` and `dist.barrier` called with async_op=False on plain contiguous
CPU tensors (arrays.call_view: no grad, a dtype numpy shares) take this path: the general
path's checks all pass for such tensors, so only what differs between calls is looked at, and
the backend is called with the tensors' numpy views on the calling thread. The views are
arrays.call_view's, which keep no memory alive: each op ends before its function returns, and
the caller holds the tensors until then. Each function
returns the finished Work, or None (nothing done) when the call is anything else or an op of the
group is queued or running (the executor's run_inline): then the general path takes it, with
its checks and its messages. Ordering and the Work contract are the executor's (executors.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist

from ..arrays import call_view
from . import ops

if TYPE_CHECKING:
    from .work import JacklringWork



@dataclass(frozen=True)
class Lane:
    """What the short path needs of one open process group, handed over once when the group is
    made: the group checks that it is open before calling in, so no function here reads it."""
    comm: Any                  # the group's backend
    size: int
    run_inline: Callable       # the executor's run_inline(what, tensors, fn, *args): the Work, or None
    reduce_plans: dict = field(default_factory=dict)  # (RedOpType, dtype) -> reduce_plan's answer


_SUM = dist.ReduceOp.SUM
_SUM_PLAN = ("SUM", ops.BACKEND_SUM, False, "allreduce(SUM)")


def reduce_plan(lane: Lane, opts: Any, tensor: Any) -> tuple | None:
    """(name, backend op, whether to divide by the size afterwards, the all-reduce's
    description) for this op and dtype, or None when the general path must refuse it (its
    message is the one to give). Looked up once per (op, dtype): reading a ReduceOp's name
    costs microseconds."""
    op = opts.reduceOp
    if op == _SUM:
        return _SUM_PLAN
    key = (op.op, tensor.dtype)
    plan = lane.reduce_plans.get(key)
    if plan is None:
        name = ops.reduce_op_name(op)
        try:
            ops.check_reduce_op(name, tensor)
        except (ValueError, TypeError):
            return None
        plan = lane.reduce_plans[key] = (name, ops.backend_op(name), name == "AVG", f"allreduce({name})")
    return plan


def all_reduce(lane: Lane, tensors: list, opts: Any) -> JacklringWork | None:
    tensor = tensors[0]
    array = call_view(tensor)
    if array is None:
        return None
    plan = _SUM_PLAN if opts.reduceOp == _SUM else reduce_plan(lane, opts, tensor)
    if plan is None:
        return None
    name, op, average, what = plan
    comm = lane.comm
    if average:
        def run() -> None:
            comm.all_reduce(array, array, op)
            ops.finish_average(tensor, name, comm.size())
        return lane.run_inline(what, tensors, run)
    # The common case calls the backend straight from run_inline: no function made per call.
    return lane.run_inline(what, tensors, comm.all_reduce, array, array, op)


def broadcast(lane: Lane, tensors: list, opts: Any) -> JacklringWork | None:
    array = call_view(tensors[0])
    root = opts.rootRank
    if array is None or not 0 <= root < lane.size:
        return None
    comm = lane.comm
    return lane.run_inline(f"broadcast(root {root})", tensors, lambda: comm.broadcast(array, root))


def _apart(a: Any, b: Any, a_bytes: int, b_bytes: int) -> bool:
    """Whether two tensors' bytes do not overlap (FSDP gathers a slice of the output); the
    tensors' addresses, since a numpy view's (ndarray.ctypes) costs microseconds."""
    lo, hi = a.data_ptr(), b.data_ptr()
    return lo + a_bytes <= hi or hi + b_bytes <= lo


def all_gather_into_tensor(lane: Lane, output: Any, input: Any) -> JacklringWork | None:
    src, dst = call_view(input), call_view(output)
    if (src is None or dst is None or dst.size != src.size * lane.size or dst.dtype != src.dtype
            or not _apart(input, output, src.nbytes, dst.nbytes)):
        return None
    comm = lane.comm
    return lane.run_inline("all_gather_into_tensor", [output], lambda: comm.all_gather(src, dst))


def reduce_scatter_tensor(lane: Lane, output: Any, input: Any, opts: Any) -> JacklringWork | None:
    src, dst = call_view(input), call_view(output)
    if (src is None or dst is None or src.size != dst.size * lane.size or dst.dtype != src.dtype
            or not _apart(input, output, src.nbytes, dst.nbytes)):
        return None
    plan = reduce_plan(lane, opts, output)
    if plan is None:
        return None
    name, op, average, _ = plan
    comm = lane.comm

    def run() -> None:
        comm.reduce_scatter(src, dst, op)
        if average:
            ops.finish_average(output, name, comm.size())
    return lane.run_inline(f"reduce_scatter_tensor({name})", [output], run)


def barrier(lane: Lane) -> JacklringWork | None:
    return lane.run_inline("barrier", [], lane.comm.barrier)
