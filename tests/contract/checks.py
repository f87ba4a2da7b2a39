"""The backend contract: every check every backend must pass, run by worker.py on each rank.

A check (a function decorated with @check; the registry keeps their order) takes a Context and
runs the same sequence of operations on every rank. Wrong results are recorded with
Context.same / expect / raises / value instead of raised, so one wrong value does not leave
the ranks out of step; the worker reports them when the check returns. Checks that can spoil
a group on a backend that gets them wrong (mismatched recvs, threads, deadlocks) run on a
sub-group of their own with a short deadline, so the checks after them keep a working world.
"""
from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

import adapter
from adapter import ReduceOp

from .values import BF16, DTYPES, data, describe, equal, reference, to_numpy, to_torch, valid_ops


@dataclass
class Context:
    group: adapter.Group
    backend: str  # the Group.backend_name the launch must produce
    size: int  # the size the launch asked for
    failures: list[str] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def n(self) -> int:
        return self.group.size()

    def same(self, got: Any, want: Any, label: str) -> None:
        if not equal(got, want):
            self.failures.append(f"rank {self.rank}: {label}: got {describe(got)}, want {describe(want)}")

    def expect(self, condition: bool, label: str) -> None:
        if not condition:
            self.failures.append(f"rank {self.rank}: {label}")

    def value(self, call: Callable[[], Any], label: str) -> Any:
        """call()'s result, or None with the exception recorded (the ranks stay in step)."""
        try:
            return call()
        except Exception as exc:
            self.failures.append(f"rank {self.rank}: {label}: {type(exc).__name__}: {exc}")
            return None

    def raises(self, kind: type, call: Callable[[], Any], label: str, words: tuple[str, ...] = ()) -> None:
        """call() must raise kind, with each of words in its message."""
        try:
            call()
        except kind as exc:
            missing = [w for w in words if w not in str(exc)]
            if missing:
                self.failures.append(f"rank {self.rank}: {label}: {type(exc).__name__} lacks {missing}: {exc}")
        except Exception as exc:
            self.failures.append(f"rank {self.rank}: {label}: raised {type(exc).__name__} instead of "
                                 f"{kind.__name__}: {exc}")
        else:
            self.failures.append(f"rank {self.rank}: {label}: did not raise {kind.__name__}")


CHECKS: dict[str, Callable[[Context], None]] = {}
# Checks that import torch (seconds of CPU per rank): a launch runs them only where asked to.
TORCH_CHECKS = ("torch_tensors_in_torch_tensors_out",)


def check(fn: Callable[[Context], None]) -> Callable[[Context], None]:
    CHECKS[fn.__name__] = fn
    return fn


def _parts(c: Context, dtype: np.dtype, count: int, salt: int = 0) -> list[np.ndarray]:
    return [data(q, dtype, count, salt) for q in range(c.n)]


# --- the group ----------------------------------------------------------------------------------


@check
def init_returns_the_launched_backend(c: Context) -> None:
    # A launch of one rank may give the plain group of one.
    c.expect(c.group.backend_name in (c.backend, "singleton" if c.n == 1 else c.backend),
             f"backend_name {c.group.backend_name!r}, launched {c.backend!r}")
    c.expect(c.n == c.size, f"size {c.n}, launched {c.size}")
    c.expect(adapter.init() is c.group, "init() returned a new group")
    c.expect(adapter.init(backend=c.backend) is c.group, f"init(backend={c.backend!r}) returned a new group")
    c.expect(adapter.is_available(c.backend), f"is_available({c.backend!r}) is False inside the launch")
    c.same(adapter.all_gather(np.array([c.rank], np.int64)), np.arange(c.n, dtype=np.int64), "ranks 0..n-1")
    launched_as = os.environ.get("MLX_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
    c.expect(launched_as is None or int(launched_as) == c.rank, f"rank {c.rank}, launched as rank {launched_as}")
    x = adapter.all_sum(np.ones(10))  # the spec's example
    c.same(x, np.full(10, float(c.n)), "all_sum(ones(10))")
    on_shm = os.environ.get("CONTRACT_SHARED_MEMORY")  # "1"/"0": whether the collectives use it (JACCL)
    if on_shm:
        said = getattr(c.group.backend, "shared_memory", None)
        c.expect(said == (on_shm == "1"), f"backend.shared_memory is {said}, expected {on_shm == '1'}")
    shared = os.environ.get("CONTRACT_SHARED_HOST")  # a variant's ranks that share a host
    if shared:
        staged = getattr(c.group.backend, "staging", None)
        here = [int(q) for q in shared.split(",") if int(q) < c.n]
        c.expect(staged is not None, "the group spans hosts but does not run in stages")
        if staged is not None:
            want = here if c.rank in here else [c.rank]
            c.expect(staged.members == want and (staged.local is not None) == (c.rank in here),
                     f"rank {c.rank} shares a host with {staged.members}, expected {want}")


# --- every op x every dtype ---------------------------------------------------------------------


@check
def all_sum_max_min_every_dtype_and_count(c: Context) -> None:
    for dtype in DTYPES:
        for count in (0, 1, 5, 1023):
            parts = _parts(c, dtype, count)
            c.same(adapter.all_sum(parts[c.rank]), reference(parts, ReduceOp.SUM), f"all_sum {dtype} x{count}")
            if dtype.kind != "c":
                c.same(adapter.all_max(parts[c.rank]), reference(parts, ReduceOp.MAX), f"all_max {dtype} x{count}")
                c.same(adapter.all_min(parts[c.rank]), reference(parts, ReduceOp.MIN), f"all_min {dtype} x{count}")


@check
def all_reduce_every_op_and_dtype(c: Context) -> None:
    for dtype in DTYPES:
        for count in (1, 10, 1023):
            parts = _parts(c, dtype, count, salt=1)
            for op in valid_ops(dtype):
                c.same(adapter.all_reduce(parts[c.rank], op), reference(parts, op), f"all_reduce {op.name} {dtype} x{count}")
    parts = _parts(c, np.dtype(np.int64), 10, salt=2)
    for op in ReduceOp:  # the names work too, in any case
        c.same(adapter.all_reduce(parts[c.rank], op.value.upper()), reference(parts, op), f"all_reduce {op.value!r}")


@check
def reductions_a_dtype_does_not_define_raise_TypeError(c: Context) -> None:
    for dtype in DTYPES:
        x = data(c.rank, dtype, 4)
        for op in set(ReduceOp) - set(valid_ops(dtype)):
            c.raises(TypeError, lambda: adapter.all_reduce(x, op), f"all_reduce {op.name} {dtype}")
            c.raises(TypeError, lambda: adapter.reduce_scatter(np.resize(x, 2 * c.n), op),
                     f"reduce_scatter {op.name} {dtype}")
    c.raises(ValueError, lambda: adapter.all_reduce(np.ones(2), "mean"), "all_reduce 'mean'", ("mean",))
    c.same(adapter.all_sum(np.ones(2)), np.full(2, float(c.n)), "usable after refused ops")


@check
def backend_all_reduce_in_place_and_into_dst(c: Context) -> None:
    """Backend.all_reduce: src may be dst; otherwise dst is written and src left alone."""
    for dtype in DTYPES:
        parts = _parts(c, dtype, 10, salt=3)
        for op in valid_ops(dtype):
            buf = parts[c.rank].copy()
            c.group.backend.all_reduce(buf, buf, op)
            c.same(buf, reference(parts, op), f"in-place all_reduce {op.name} {dtype}")
    src = np.full(4, c.rank, np.int32)
    dst = np.empty(4, np.int32)
    c.group.backend.all_reduce(src, dst, ReduceOp.SUM)
    c.same(dst, np.full(4, sum(range(c.n)), np.int32), "all_reduce writes dst")
    c.same(src, np.full(4, c.rank, np.int32), "all_reduce leaves src")


@check
def sum_scatter_and_reduce_scatter_every_op_and_dtype(c: Context) -> None:
    for dtype in DTYPES:
        for block in (1, 10):
            parts = _parts(c, dtype, block * c.n, salt=4)
            mine = slice(c.rank * block, (c.rank + 1) * block)
            for op in valid_ops(dtype):
                c.same(adapter.reduce_scatter(parts[c.rank], op), reference(parts, op)[mine],
                       f"reduce_scatter {op.name} {dtype} x{block}")
            c.same(adapter.sum_scatter(parts[c.rank]), reference(parts, ReduceOp.SUM)[mine], f"sum_scatter {dtype}")
    blocks = np.arange(c.n * 3 * 5, dtype=np.int32).reshape(c.n * 3, 5)
    c.same(adapter.sum_scatter(blocks + c.rank), (blocks * c.n + c.n * (c.n - 1) // 2)[c.rank * 3:(c.rank + 1) * 3],
           "2-d sum_scatter keeps the trailing shape")


@check
def all_gather_every_dtype_and_shape(c: Context) -> None:
    for dtype in DTYPES:
        for count in (0, 1, 5, 1023):
            parts = _parts(c, dtype, count, salt=6)
            c.same(adapter.all_gather(parts[c.rank]), np.concatenate(parts), f"all_gather {dtype} x{count}")
        parts = [p.reshape(2, 5) for p in _parts(c, dtype, 10, salt=7)]
        c.same(adapter.all_gather(parts[c.rank]), np.concatenate(parts), f"all_gather {dtype} (2, 5)")


@check
def every_dtype_above_the_pipelining_threshold(c: Context) -> None:
    """70001 elements: above 64 KiB in every dtype, so the ring and JACCL take their pipelined,
    blocked algorithms (the checks above stay below it)."""
    count = 70_001
    for dtype in DTYPES:
        parts = _parts(c, dtype, count, salt=14)
        c.same(adapter.all_sum(parts[c.rank]), reference(parts, ReduceOp.SUM), f"all_sum {dtype} x{count}")
        if dtype.kind != "c":
            c.same(adapter.all_max(parts[c.rank]), reference(parts, ReduceOp.MAX), f"all_max {dtype} x{count}")
            c.same(adapter.all_min(parts[c.rank]), reference(parts, ReduceOp.MIN), f"all_min {dtype} x{count}")
        c.same(adapter.all_gather(parts[c.rank]), np.concatenate(parts), f"all_gather {dtype} x{count}")
        block = count // c.n + 1
        blocks = _parts(c, dtype, block * c.n, salt=15)
        c.same(adapter.sum_scatter(blocks[c.rank]), reference(blocks, ReduceOp.SUM)[c.rank * block:(c.rank + 1) * block],
               f"sum_scatter {dtype} x{block * c.n}")
    parts = _parts(c, np.dtype(np.int64), count, salt=16)
    for op in ReduceOp:
        c.same(adapter.all_reduce(parts[c.rank], op), reference(parts, op), f"all_reduce {op.name} int64 x{count}")


@check
def broadcast_from_every_root(c: Context) -> None:
    for dtype in DTYPES:
        parts = _parts(c, dtype, 10, salt=8)
        for root in range(c.n):
            c.same(adapter.broadcast(parts[c.rank], root), parts[root], f"broadcast {dtype} root {root}")
    for root in range(c.n):
        x = np.full(70_000, c.rank, np.int32)
        c.same(adapter.broadcast(x, root), np.full(70_000, root, np.int32), f"broadcast x70000 root {root}")
        c.same(x, np.full(70_000, c.rank, np.int32), "broadcast leaves its input alone")
    c.same(adapter.broadcast(np.array(c.rank * 7), root=c.n - 1), np.array((c.n - 1) * 7), "0-d broadcast")


@check
def barrier_waits_for_every_rank(c: Context) -> None:
    adapter.barrier()
    late = c.n - 1
    start = time.monotonic()
    if c.rank == late:
        time.sleep(0.3)
    adapter.barrier()
    waited = time.monotonic() - start
    c.expect(waited >= 0.25, f"barrier returned after {waited:.3f} s although rank {late} arrived 0.3 s late")
    for _ in range(5):
        adapter.barrier()


# --- point to point -----------------------------------------------------------------------------


@check
def send_recv_every_dtype_between_every_pair(c: Context) -> None:
    for dtype in DTYPES:
        parts = _parts(c, dtype, 10, salt=9)
        for src in range(c.n):
            for dst in range(c.n):
                if src == dst:
                    continue
                if c.rank == src:
                    returned = adapter.send(parts[src], dst)
                    c.expect(returned is parts[src], "send returns its input")
                elif c.rank == dst:
                    c.same(adapter.recv((10,), dtype, src), parts[src], f"recv {dtype} {src}->{dst}")
        adapter.barrier()


@check
def send_recv_any_pair_in_both_orders_and_sizes(c: Context) -> None:
    for a in reversed(range(c.n)):
        for b in reversed(range(c.n)):
            if a != b and c.rank in (a, b):
                msg = np.arange(300_000, dtype=np.float32) + a  # many frames / segments
                if c.rank == a:
                    adapter.send(msg, b)
                else:
                    c.same(adapter.recv_like(msg, a), msg, f"recv_like x300000 {a}->{b}")
    last = c.n - 1
    if c.rank == 0:  # first <-> last: a round trip
        adapter.send(np.array([1, 2, 3], np.int16), last)
        c.same(adapter.recv((3,), np.int16, last), np.array([4, 5, 6], np.int16), "reply from the last rank")
    elif c.rank == last:
        c.same(adapter.recv((3,), np.int16, 0), np.array([1, 2, 3], np.int16), "request from rank 0")
        adapter.send(np.array([4, 5, 6], np.int16), 0)
    dst, src = (c.rank + 1) % c.n, (c.rank - 1) % c.n  # around the ring: everyone sends first
    adapter.send(np.arange(6, dtype=np.int32).reshape(2, 3) + c.rank, dst)
    c.same(adapter.recv((2, 3), np.int32, src), np.arange(6, dtype=np.int32).reshape(2, 3) + src, "2-d around the ring")
    adapter.barrier()


@check
def send_recv_edge_inputs(c: Context) -> None:
    dst, src = (c.rank + 1) % c.n, (c.rank - 1) % c.n
    strided = np.arange(20, dtype=np.float32)[::2]
    adapter.send(strided, dst)
    c.same(adapter.recv((10,), np.float32, src), np.arange(20, dtype=np.float32)[::2], "strided message")
    c.same(strided, np.arange(20, dtype=np.float32)[::2], "send leaves its input alone")
    adapter.send(np.array(5, np.int16), dst)
    c.same(adapter.recv((), np.int16, src), np.array(5, np.int16), "0-d message")
    adapter.send(np.zeros((0, 3), np.float32), dst)
    c.same(adapter.recv((0, 3), np.float32, src), np.zeros((0, 3), np.float32), "empty message")
    adapter.send(np.asfortranarray(np.arange(6).reshape(2, 3)), dst)
    c.same(adapter.recv((2, 3), np.int64, src), np.arange(6).reshape(2, 3), "Fortran-ordered message")
    adapter.send(np.arange(4, dtype=np.int8), dst)
    c.same(adapter.recv(4, np.int8, src), np.arange(4, dtype=np.int8), "recv with an int shape")
    readonly = np.ones(5, np.float32)
    readonly.flags.writeable = False
    adapter.send(readonly, dst)
    c.same(adapter.recv((5,), np.float32, src), np.ones(5, np.float32), "read-only message")
    adapter.send(np.arange(3, dtype=">i4"), dst)
    c.same(adapter.recv((3,), np.int32, src), np.arange(3, dtype=np.int32), "big-endian message")
    like = adapter.recv_like(np.zeros(4, np.float64), src) if c.rank % 2 else None
    if c.rank % 2 == 0 and c.rank + 1 < c.n:
        adapter.send(np.full(4, c.rank, np.float64), c.rank + 1)
    if like is not None:
        c.same(like, np.full(4, c.rank - 1.0), "recv_like numpy")
    adapter.barrier()


@check
def bad_peer_or_root_is_a_ValueError(c: Context) -> None:
    for bad in (c.rank, c.n, -1):
        c.raises(ValueError, lambda: adapter.send(np.ones(1), bad), f"send to {bad}")
        c.raises(ValueError, lambda: adapter.recv((1,), np.float64, bad), f"recv from {bad}")
        c.raises(ValueError, lambda: adapter.recv_like(np.ones(1), bad), f"recv_like from {bad}")
    for bad in (c.n, -1, c.n + 5):
        c.raises(ValueError, lambda: adapter.broadcast(np.ones(1), root=bad), f"broadcast root {bad}")
    c.same(adapter.all_sum(np.ones(2)), np.full(2, float(c.n)), "usable after refused calls")


@check
def sum_scatter_of_an_indivisible_first_axis_is_a_ValueError(c: Context) -> None:
    c.raises(ValueError, lambda: adapter.sum_scatter(np.ones(c.n + 1)), "sum_scatter of n + 1 elements", ("divisible",))
    c.raises(ValueError, lambda: adapter.sum_scatter(np.array(1.0)), "sum_scatter of a 0-d array")
    c.raises(ValueError, lambda: adapter.reduce_scatter(np.ones((c.n + 1, 2)), "max"), "reduce_scatter (n + 1, 2)")
    c.same(adapter.sum_scatter(np.ones(c.n * 3)), np.full(3, float(c.n)), "usable after refused calls")


# --- edge inputs --------------------------------------------------------------------------------


@check
def zero_d_inputs(c: Context) -> None:
    x = np.array(c.rank + 1.0, np.float32)
    c.same(adapter.all_sum(x), np.array(c.n * (c.n + 1) / 2, np.float32), "0-d all_sum")
    c.same(adapter.all_max(x), np.array(c.n, np.float32), "0-d all_max")
    c.same(adapter.all_min(x), np.array(1, np.float32), "0-d all_min")
    c.same(adapter.all_gather(np.float64(c.rank)), np.arange(c.n, dtype=np.float64), "numpy scalar all_gather")
    c.same(adapter.all_gather(np.array(c.rank, np.int32)), np.arange(c.n, dtype=np.int32), "0-d all_gather")
    c.same(np.ravel(adapter.all_sum(np.float64(c.rank))), np.array([float(sum(range(c.n)))]), "numpy scalar all_sum")


@check
def empty_inputs(c: Context) -> None:
    for shape in [(0,), (0, 3), (3, 0)]:
        x = np.zeros(shape, np.float32)
        c.same(adapter.all_sum(x), x, f"all_sum {shape}")
        c.same(adapter.all_max(x), x, f"all_max {shape}")
        c.same(adapter.all_reduce(x, "prod"), x, f"all_reduce prod {shape}")
        c.same(adapter.all_gather(x), np.zeros((c.n * shape[0],) + shape[1:], np.float32), f"all_gather {shape}")
        c.same(adapter.broadcast(x, c.n - 1), x, f"broadcast {shape}")
    for shape in [(0,), (0, 4)]:
        c.same(adapter.sum_scatter(np.zeros(shape)), np.zeros(shape), f"sum_scatter {shape}")
    c.same(adapter.sum_scatter(np.zeros((c.n, 0))), np.zeros((1, 0)), "sum_scatter (n, 0)")


@check
def layouts_are_read_right_and_inputs_never_modified(c: Context) -> None:
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    views: list[Callable[[np.ndarray], np.ndarray]] = [
        np.asfortranarray, lambda a: a[::-1], lambda a: a[:, ::-2], lambda a: a.T, lambda a: a[1:3, 2:5]]
    for i, view in enumerate(views):
        x = view(base + c.rank)
        keep = x.copy()
        c.same(adapter.all_sum(x), sum(view(base + q) for q in range(c.n)), f"all_sum layout {i}")
        c.same(adapter.all_max(x), view(base + c.n - 1), f"all_max layout {i}")
        c.same(adapter.all_gather(x), np.concatenate([view(base + q) for q in range(c.n)]), f"all_gather layout {i}")
        c.same(adapter.broadcast(x, root=0), view(base), f"broadcast layout {i}")
        if x.shape[0] % c.n == 0:
            k = x.shape[0] // c.n
            c.same(adapter.sum_scatter(x), sum(view(base + q) for q in range(c.n))[c.rank * k:(c.rank + 1) * k],
                   f"sum_scatter layout {i}")
        c.same(x, keep, f"layout {i} input untouched")
    for count in (7, 100_000):  # one-step and block algorithms
        x = np.full(count * c.n, c.rank + 1.0, np.float32)
        keep = x.copy()
        c.same(adapter.all_sum(x), np.full(count * c.n, c.n * (c.n + 1) / 2, np.float32), f"all_sum x{count * c.n}")
        c.same(adapter.sum_scatter(x), np.full(count, c.n * (c.n + 1) / 2, np.float32), f"sum_scatter x{count * c.n}")
        c.same(x, keep, "large input untouched")


@check
def read_only_and_big_endian_inputs(c: Context) -> None:
    x = np.ones(10_000, np.float32)
    x.flags.writeable = False
    c.same(adapter.all_sum(x), np.full(10_000, float(c.n), np.float32), "read-only all_sum")
    c.same(adapter.all_gather(x), np.ones(10_000 * c.n, np.float32), "read-only all_gather")
    c.same(adapter.broadcast(x), x, "read-only broadcast")
    y = np.ones(4 * c.n)
    y.flags.writeable = False
    c.same(adapter.sum_scatter(y), np.full(4, float(c.n)), "read-only sum_scatter")
    for dt in (">f4", ">i8", ">c16"):
        be = np.arange(3, dtype=dt) + c.rank
        native = np.dtype(dt).newbyteorder("=")
        c.same(adapter.all_sum(be), (np.arange(3) * c.n + sum(range(c.n))).astype(native), f"big-endian {dt} all_sum")
        c.same(adapter.all_gather(be), np.concatenate([np.arange(3) + q for q in range(c.n)]).astype(native),
               f"big-endian {dt} all_gather")


@check
def torch_tensors_in_torch_tensors_out(c: Context) -> None:
    import torch

    pairs = [(np.float32, torch.float32), (BF16, torch.bfloat16), (np.float16, torch.float16),
             (np.int64, torch.int64), (np.int8, torch.int8), (np.bool_, torch.bool), (np.complex64, torch.complex64),
             (np.uint16, torch.uint16), (np.uint64, torch.uint64), (np.float64, torch.float64)]
    for dtype, tdtype in pairs:
        dtype = np.dtype(dtype)
        parts = _parts(c, dtype, 6, salt=10)
        mine = to_torch(parts[c.rank])
        for name, call, want in (
                ("all_sum", adapter.all_sum, reference(parts, ReduceOp.SUM)),
                ("all_gather", adapter.all_gather, np.concatenate(parts)),
                ("broadcast", lambda t: adapter.broadcast(t, c.n - 1), parts[-1])) + (
                (("all_max", adapter.all_max, reference(parts, ReduceOp.MAX)),) if dtype.kind != "c" else ()):
            out = call(mine)
            c.expect(isinstance(out, torch.Tensor) and out.dtype == tdtype, f"torch {name} {tdtype} gave {out!r}")
            c.same(to_numpy(out), want, f"torch {name} {tdtype}")
        if c.rank == 0:
            adapter.send(mine, 1)
            adapter.send(mine, 1)
        elif c.rank == 1:
            got = adapter.recv_like(mine, 0)
            c.expect(isinstance(got, torch.Tensor) and got.dtype == tdtype, f"torch recv_like {tdtype} gave {got!r}")
            c.same(to_numpy(got), parts[0], f"torch recv_like {tdtype}")
            got = adapter.recv((6,), tdtype, 0)
            c.expect(isinstance(got, torch.Tensor) and got.dtype == tdtype, f"torch recv {tdtype} gave {got!r}")
            c.same(to_numpy(got), parts[0], f"torch recv {tdtype}")
    t = adapter.all_sum(torch.tensor(2.0))
    c.expect(isinstance(t, torch.Tensor) and t.shape == () and t.item() == 2 * c.n, f"0-d tensor all_sum {t!r}")
    w = torch.ones(5, requires_grad=True)
    s = adapter.all_sum(w)
    c.expect(torch.all(s == c.n).item() and not s.requires_grad and torch.all(w == 1).item(), "requires_grad input")
    base = torch.arange(20, dtype=torch.float32).reshape(4, 5) + c.rank
    keep = base.clone()
    want = sum((torch.arange(20, dtype=torch.float32).reshape(4, 5) + q)[:, 1::2] for q in range(c.n))
    c.expect(torch.equal(adapter.all_sum(base[:, 1::2]), want), "strided tensor all_sum")
    c.expect(torch.equal(adapter.broadcast(base[:, 1::2], root=0), (base - c.rank)[:, 1::2]), "strided tensor broadcast")
    c.expect(adapter.all_gather(base.t()).shape == (5 * c.n, 4), "transposed tensor all_gather")
    c.expect(torch.equal(adapter.all_sum(base.t()), sum(torch.arange(20.).reshape(4, 5) + q for q in range(c.n)).t()),
             "transposed tensor all_sum")
    c.expect(torch.equal(base, keep), "torch input modified")
    conj = adapter.all_sum(torch.tensor([1 + 1j], dtype=torch.complex64).conj())
    c.expect(conj.tolist() == [c.n * (1 - 1j)], f"conj view all_sum {conj}")
    bf = adapter.all_sum(torch.ones(3, 4, dtype=torch.bfloat16) * (c.rank + 1))
    c.expect(bf.dtype == torch.bfloat16 and bf.shape == (3, 4) and torch.all(bf == c.n * (c.n + 1) / 2).item(),
             f"bfloat16 (3, 4) all_sum {bf}")
    frozen = torch.ones(4)
    frozen.numpy().flags.writeable = False
    c.expect(torch.all(adapter.all_sum(frozen) == c.n).item() and torch.all(frozen == 1).item(), "frozen tensor")
    t = torch.arange(c.n * 4 * 3, dtype=torch.float32).reshape(c.n * 4, 3) * (c.rank + 1)
    out = adapter.sum_scatter(t)
    want2 = (np.arange(c.n * 4 * 3, dtype=np.float32).reshape(c.n * 4, 3) * sum(range(1, c.n + 1)))[c.rank * 4:(c.rank + 1) * 4]
    c.expect(isinstance(out, torch.Tensor), "torch sum_scatter returns a tensor")
    c.same(to_numpy(out), want2, "torch 2-d sum_scatter")


@check
def plain_python_lists(c: Context) -> None:
    c.same(adapter.sum_scatter([1.0] * c.n), np.array([float(c.n)]), "sum_scatter of a list")
    c.same(adapter.all_sum([1, 2, 3]), np.array([1, 2, 3]) * c.n, "all_sum of a list")
    c.same(adapter.all_gather([c.rank]), np.arange(c.n), "all_gather of a list")
    c.same(adapter.broadcast([c.rank, 1.5], root=c.n - 1), np.array([c.n - 1, 1.5]), "broadcast of a list")


@check
def counts_around_the_algorithm_thresholds(c: Context) -> None:
    """64 KiB switches the ring and JACCL between the one-step and the pipelined algorithms;
    counts one below, at and one above it, in several element sizes, for every collective."""
    from adapter import config

    limits = {64 << 10, config.get("JACKLRING_RING_SMALL_BYTES")}
    for limit in sorted(limits):
        for dtype in (np.dtype(np.int8), np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.complex128)):
            at = max(limit // dtype.itemsize, 1)
            for count in (at - 1, at, at + 1):
                if count <= 0:
                    continue
                parts = _parts(c, dtype, count, salt=11)
                c.same(adapter.all_sum(parts[c.rank]), reference(parts, ReduceOp.SUM), f"all_sum {dtype} x{count}")
                c.same(adapter.all_gather(parts[c.rank]), np.concatenate(parts), f"all_gather {dtype} x{count}")
                c.same(adapter.broadcast(parts[c.rank], count % c.n), parts[count % c.n], f"broadcast {dtype} x{count}")
                for total in (count - count % c.n, count + c.n - count % c.n):
                    blocks = _parts(c, dtype, total, salt=12)
                    k = total // c.n
                    c.same(adapter.sum_scatter(blocks[c.rank]), reference(blocks, ReduceOp.SUM)[c.rank * k:(c.rank + 1) * k],
                           f"sum_scatter {dtype} x{total}")


@check
def large_uneven_prime_counts(c: Context) -> None:
    m = 1_000_003  # prime: not divisible by ranks x channels x segments
    x = np.arange(m, dtype=np.float32) % 97 + c.rank
    c.same(adapter.all_sum(x), (np.arange(m, dtype=np.float32) % 97) * c.n + c.n * (c.n - 1) / 2, "all_sum x1000003")
    got = adapter.all_gather(x[:300_001])
    c.expect(got.shape == (c.n * 300_001,) and got[300_001 * (c.n - 1)] == c.n - 1, "all_gather x300001")
    c.same(adapter.sum_scatter(np.ones(c.n * 70_001, np.int64) * (c.rank + 1)),
           np.full(70_001, c.n * (c.n + 1) // 2, np.int64), "sum_scatter n x 70001")
    for dtype in (np.dtype(np.float16), BF16):
        parts = _parts(c, dtype, 300_001, salt=13)
        for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN):
            c.same(adapter.all_reduce(parts[c.rank], op), reference(parts, op), f"all_reduce {op.name} {dtype} x300001")
        k = 300_001 // c.n
        c.same(adapter.sum_scatter(parts[c.rank][:k * c.n]),
               reference([p[:k * c.n] for p in parts], ReduceOp.SUM)[c.rank * k:(c.rank + 1) * k], f"sum_scatter {dtype}")


@check
def nan_inf_and_extreme_values(c: Context) -> None:
    r, n = c.rank, c.n
    u = np.array([np.iinfo(np.uint64).max, 0, 2**63], np.uint64)
    c.same(adapter.all_max(u), u, "uint64 extremes max")
    c.same(adapter.all_min(u), u, "uint64 extremes min")
    c.same(adapter.all_sum(np.array([np.iinfo(np.uint64).max], np.uint64)), np.array([2**64 - n], np.uint64),
           "uint64 sum wraps around")
    big = np.array([2**63 + r, 2**64 - 1 - r], np.uint64)
    c.same(adapter.all_max(big), np.array([2**63 + n - 1, 2**64 - 1], np.uint64), "uint64 max above 2**63")
    i = np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max], np.int64)
    c.same(adapter.all_max(i), i, "int64 extremes")
    c.same(adapter.all_sum(np.array([127, -128], np.int8)), np.array([127, -128], np.int8) * np.int8(n),
           "int8 sum wraps around")
    for dt in (np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)):
        vals = np.array([np.nan if r == 0 else 1, np.inf, -np.inf, 0], dt)
        mx, mn = np.asarray(adapter.all_max(vals), np.float64), np.asarray(adapter.all_min(vals), np.float64)
        c.expect(np.isnan(mx[0]) and np.isnan(mn[0]), f"{dt}: a NaN on rank 0 is lost: max {mx}, min {mn}")
        c.expect(mx[1] == np.inf and mn[2] == -np.inf, f"{dt}: infinities lost: max {mx}, min {mn}")
        s = adapter.all_sum(np.array([float(np.finfo(dt).max) if dt != BF16 else 3.3e38], dt))
        c.expect(np.isinf(np.float64(s[0])), f"{dt}: max + max is not inf: {s}")
        for count in (3, 50_000):  # a NaN from the first and the last rank, both algorithms
            x = np.ones(count, dt)
            if r == n - 1:
                x[1] = np.nan
            if r == 0:
                x[2] = np.nan
            for name, fn in (("max", adapter.all_max), ("min", adapter.all_min)):
                got = np.asarray(fn(x), np.float64)
                c.expect(bool(np.isnan(got[1]) and np.isnan(got[2]) and got[0] == 1),
                         f"NaN through {name} {dt} x{count}: {got[:3]}")
    flags = np.array([r == 0, True, False, r == 1])
    c.same(adapter.all_sum(flags), np.array([True, True, False, n > 1]), "bool sum is or")
    c.same(adapter.all_min(flags), np.array([n == 1, True, False, False]), "bool min is and")
    cx = adapter.all_sum(np.array([1 + 2j, r * 1j], np.complex64))
    c.same(cx, np.array([n * (1 + 2j), 1j * n * (n - 1) / 2], np.complex64), "complex64 sum")
    c.same(adapter.all_gather(np.array([r + 1j], np.complex128)), np.arange(n) + 1j, "complex128 gather")
    h = adapter.all_sum(np.full(100_000, 0.1, np.float16))
    c.expect(abs(float(h[0]) - 0.1 * n) < 0.01 and abs(float(h[-1]) - 0.1 * n) < 0.01, f"float16 0.1 sum {h[:3]}")
    bf = adapter.all_sum(np.full(100_000, 1.0 + r, BF16))
    c.same(bf, np.full(100_000, n * (n + 1) / 2, BF16), "bfloat16 long sum")


# --- groups -------------------------------------------------------------------------------------


@check
def split_every_way(c: Context) -> None:
    r, n, world = c.rank, c.n, c.group
    halves = world.split(r % 2, key=n - r)  # reversed order inside each half
    members = sorted((k for k in range(n) if k % 2 == r % 2), key=lambda k: n - k)
    c.expect(halves.size() == 1 or halves.backend_name == c.backend, f"split backend {halves.backend_name}")
    c.expect((halves.size(), halves.rank()) == (len(members), members.index(r)), f"halves {halves}")
    c.same(adapter.all_gather(np.array([r], np.int64), group=halves), np.array(members, np.int64), "half gather")
    c.same(adapter.all_sum(np.full(3, r, np.int64), group=halves), np.full(3, sum(members), np.int64), "half sum")
    c.same(adapter.all_sum(np.ones(200_000, np.float32) * r, group=halves),
           np.full(200_000, sum(members), np.float32), "half sum x200000")
    c.same(adapter.all_sum(np.full(5, r + 1, BF16), group=halves), np.full(5, sum(m + 1 for m in members), BF16),
           "half bfloat16 sum")
    c.same(adapter.broadcast(np.array([r]), root=len(members) - 1, group=halves), np.array([members[-1]]),
           "half broadcast")
    nested = halves.split(0, key=0)  # equal keys: ordered by rank in halves
    c.expect((nested.size(), nested.rank()) == (halves.size(), halves.rank()), f"nested {nested}")
    c.same(adapter.all_sum(np.array([1.0]), group=nested), np.array([float(len(members))]), "nested sum")
    if nested.size() > 1 and nested.rank() == 0:
        adapter.send(np.array([7.0]), nested.size() - 1, group=nested)
    elif nested.size() > 1 and nested.rank() == nested.size() - 1:
        c.same(adapter.recv((1,), np.float64, 0, group=nested), np.array([7.0]), "nested p2p")
    signed = world.split(-5 if r == 0 else 3)  # a negative color is a color like any other
    c.expect(signed.size() == (1 if r == 0 else n - 1), f"negative color: size {signed.size()}")
    c.same(adapter.all_sum(np.array([1]), group=signed), np.array([1 if r == 0 else n - 1]), "negative color sum")
    rev = world.split(0, key=-5 - r)  # negative keys: treated as "by rank"
    c.expect((rev.size(), rev.rank()) == (n, r), f"negative keys: {rev}")
    c.same(adapter.all_sum(np.array([r]), group=rev), np.array([n * (n - 1) // 2]), "negative keys sum")
    by_key = world.split(7, key=100 - r)  # one color, reversed keys
    c.expect(by_key.rank() == n - 1 - r, f"reversed keys: rank {by_key.rank()}")
    c.same(adapter.all_gather(np.array([r]), group=by_key), np.arange(n)[::-1], "reversed keys gather")
    adapter.barrier()
    c.same(adapter.all_sum(np.array([1])), np.array([n]), "world after splits")
    for sub in (halves, nested, signed, rev, by_key):
        sub.backend.close()


@check
def group_of_one_returns_its_inputs(c: Context) -> None:
    alone = c.group if c.n == 1 else c.group.split(c.rank)
    c.expect((alone.size(), alone.rank()) == (1, 0), f"a group of one: {alone}")
    x = np.arange(6, dtype=np.float32).reshape(2, 3) + c.rank
    for name, call in (("all_sum", adapter.all_sum), ("all_max", adapter.all_max), ("all_min", adapter.all_min),
                       ("all_gather", adapter.all_gather), ("sum_scatter", adapter.sum_scatter),
                       ("all_reduce prod", lambda v, group: adapter.all_reduce(v, "prod", group=group)),
                       ("broadcast", lambda v, group: adapter.broadcast(v, 0, group=group))):
        c.same(call(x, group=alone), x, f"{name} in a group of one")
    adapter.barrier(group=alone)
    c.raises(ValueError, lambda: adapter.send(x, 0, group=alone), "send to itself in a group of one")
    c.raises(ValueError, lambda: adapter.broadcast(x, 1, group=alone), "broadcast root 1 in a group of one")
    if alone is not c.group:
        alone.backend.close()


# --- the error paths ----------------------------------------------------------------------------


@check
def recv_of_the_wrong_size_or_dtype_is_a_MismatchError_naming_both_ranks(c: Context) -> None:
    """The first wrong recv raises MismatchError naming both ranks. After it the group either
    stays usable (the next recv gets the next message) or says it is unusable; never garbage.
    Messages of at most 5 bytes (one message on every backend, even MPI cut at 7 elements), on a
    sub-group of their own, so a backend that gets it wrong spoils only that group."""
    sub = c.group.split(0)
    sub.backend.set_timeout(10)
    if c.rank == 0:
        adapter.send(np.arange(4, dtype=np.uint8), 1, group=sub)  # wrong dtype, same size
        adapter.send(np.arange(5, dtype=np.int8), 1, group=sub)  # wrong size
        adapter.send(np.arange(4, dtype=np.int8), 1, group=sub)
    elif c.rank == 1:
        c.raises(adapter.MismatchError, lambda: adapter.recv((4,), np.int8, 0, group=sub), "recv of the wrong dtype",
                 ("rank 1", "rank 0"))
        for what in ("wrong size", "right message"):
            try:
                got = adapter.recv((4,), np.int8, 0, group=sub)
            except adapter.MismatchError as exc:
                c.expect(what == "wrong size" and "rank 1" in str(exc) and "rank 0" in str(exc),
                         f"recv of the {what}: {exc}")
            except adapter.DistributedError as exc:
                c.expect("unusable" in str(exc), f"recv of the {what}: neither a result nor 'unusable': {exc}")
                break
            else:
                c.expect(what == "right message", f"recv of the {what} returned {got}")
                c.same(got, np.arange(4, dtype=np.int8), f"recv of the {what}")
    adapter.barrier()
    sub.backend.close()


# --- threads ------------------------------------------------------------------------------------


def _in_thread(target: Callable[[], None], errors: list[str]) -> threading.Thread:
    def run() -> None:
        try:
            target()
        except Exception:
            errors.append(traceback.format_exc())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _fresh_group(c: Context, timeout: float = 3) -> adapter.Group:
    """A sub-group with the world's ranks and a short deadline: a backend that fails a thread
    check spoils this group only, not the ones the later checks use."""
    sub = c.group.split(0)
    sub.backend.set_timeout(timeout)
    return sub


@check
def two_groups_used_from_two_threads(c: Context) -> None:
    world = _fresh_group(c)
    half = world.split(c.rank % 2)
    errors: list[str] = []

    def on_half() -> None:
        for i in range(30):
            got = adapter.all_sum(np.full(50_000 if i % 3 == 0 else 7, 1.0), group=half)
            assert np.all(got == half.size()), got[:3]

    thread = _in_thread(on_half, errors)
    for i in range(30):
        got = c.value(lambda: adapter.all_sum(np.full(60_000 if i % 4 == 0 else 5, 2.0), group=world), "world sum")
        c.expect(got is None or bool(np.all(got == 2 * c.n)), f"world sum {got}")
    thread.join(60)
    c.expect(not thread.is_alive() and not errors, f"sub-group thread: alive={thread.is_alive()} {errors}")
    adapter.barrier()
    half.backend.close()
    world.backend.close()


@check
def send_recv_in_a_thread_while_collectives_run(c: Context) -> None:
    sub = _fresh_group(c)
    dst, src = (c.rank + 1) % c.n, (c.rank - 1) % c.n
    errors: list[str] = []

    def p2p() -> None:
        for i in range(20):
            adapter.send(np.full(1000, i, np.int32), dst, group=sub)
            got = adapter.recv((1000,), np.int32, src, group=sub)
            assert np.all(got == i), got[:3]

    thread = _in_thread(p2p, errors)
    for _ in range(20):
        got = c.value(lambda: adapter.all_sum(np.ones(3000), group=sub), "all_sum beside p2p")
        c.expect(got is None or bool(np.all(got == c.n)), f"all_sum beside p2p: {got}")
        c.value(lambda: adapter.barrier(group=sub), "barrier beside p2p")
    thread.join(60)
    c.expect(not thread.is_alive() and not errors, f"p2p thread: alive={thread.is_alive()} {errors}")
    adapter.barrier()
    sub.backend.close()


@check
def two_threads_sending_to_one_peer_never_interleave(c: Context) -> None:
    sub = _fresh_group(c)
    dst, src = (c.rank + 1) % c.n, (c.rank - 1) % c.n
    errors: list[str] = []

    def sender(value: float) -> None:
        for _ in range(10):
            adapter.send(np.full(100_000, value, np.float64), dst, group=sub)

    threads = [_in_thread(lambda v=v: sender(v), errors) for v in (1.0, 2.0)]
    seen = []
    for _ in range(20):
        got = c.value(lambda: adapter.recv((100_000,), np.float64, src, group=sub), "recv")
        if got is None:
            break
        c.expect(got[0] in (1.0, 2.0) and bool(np.all(got == got[0])), f"a message mixed two senders: {got[:3]}")
        seen.append(float(got[0]))
    for thread in threads:
        thread.join(60)
    c.expect(not errors, f"sender threads: {errors}")
    c.expect(sorted(seen) == [1.0] * 10 + [2.0] * 10, f"messages seen: {seen}")
    adapter.barrier()
    sub.backend.close()


# --- closing and breaking groups ---------------------------------------------------------------


@check
def use_after_close_is_a_DistributedError_saying_closed(c: Context) -> None:
    sub = c.group.split(0)
    c.same(adapter.all_sum(np.ones(2), group=sub), np.full(2, float(c.n)), "sub-group before close")
    sub.backend.close()
    sub.backend.close()  # twice is fine
    calls = {
        "all_sum": lambda: adapter.all_sum(np.ones(2), group=sub),
        "all_gather": lambda: adapter.all_gather(np.ones(2), group=sub),
        "sum_scatter": lambda: adapter.sum_scatter(np.ones(2 * c.n), group=sub),
        "broadcast": lambda: adapter.broadcast(np.ones(2), 0, group=sub),
        "barrier": lambda: adapter.barrier(group=sub),
        "send": lambda: adapter.send(np.ones(1), (c.rank + 1) % c.n, group=sub),
        "recv": lambda: adapter.recv((1,), np.float64, (c.rank + 1) % c.n, group=sub),
        "split": lambda: sub.split(0),
    }
    for name, call in calls.items():
        c.raises(adapter.DistributedError, call, f"{name} after close", ("closed",))
    c.same(adapter.all_sum(np.ones(2)), np.full(2, float(c.n)), "the world after closing a sub-group")


@check
def every_rank_sends_before_it_receives(c: Context) -> None:
    """A symmetric exchange of 2 MB messages, far above socket buffers and MPI's eager limit: a
    send that blocks until the peer receives deadlocks here. On a sub-group of its own, so a
    backend that deadlocks spoils only that group."""
    sub = c.group.split(0)
    sub.backend.set_timeout(5)  # a deadlock costs seconds, not the launch's deadline
    count = 500_000

    def exchange() -> None:
        for peer in range(c.n):
            if peer != c.rank:
                adapter.send(np.full(count, 10 * c.rank + peer, np.float32), peer, group=sub)
        for peer in range(c.n):
            if peer != c.rank:
                c.same(adapter.recv((count,), np.float32, peer, group=sub),
                       np.full(count, 10 * peer + c.rank, np.float32), f"from {peer}")

    c.value(exchange, "symmetric exchange")
    adapter.barrier()
    sub.backend.close()


