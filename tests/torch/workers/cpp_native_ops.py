"""The C++ Backend's native collectives (JACKLRING_TORCH_NATIVE default): one route and one
sequence number whatever async_op each rank passes, the native ops against gloo, and the Works
of asynchronous native ops (wait with a timeout, errors, futures).

With the argument "mixed-routes" rank 0 runs the C++ Backend and every other rank the Python
group (=0) on the same shared segment: every header the native path packs must then be the
Python path's, byte for byte, sequence number included, or the engine reports a mismatch."""
from __future__ import annotations

import datetime
import os
import sys
import time

MIXED = "mixed-routes" in sys.argv[4:]
if MIXED:  # before the group forms (config is read when the group is created)
    os.environ["JACKLRING_TORCH_NATIVE"] = "1" if sys.argv[1] == "0" else "0"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import init  # noqa: E402
from cpp_backend import python_calls  # noqa: E402


def main() -> None:
    rank, world = init(timeout_s=30)
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    except RuntimeError:  # the Python group: torch keeps no C++ backend for it
        backend = None
    native = type(backend).__name__ == "JacklringBackend" and backend.native
    assert native == (not MIXED or rank == 0), (native, MIXED, rank)
    gloo = dist.new_group(backend="gloo")

    # Ranks disagree on async_op for the same all-reduces, between ops handed to Python (AVG,
    # all_to_all): the route and the header's sequence number must not depend on it.
    t = torch.ones(6)
    for i in range(6):
        work = dist.all_reduce(t, async_op=(rank + i) % 2 == 0)
        if work is not None:
            work.wait()
        avg = torch.full((3,), float(rank))
        dist.all_reduce(avg, op=dist.ReduceOp.AVG, async_op=(rank + i) % 3 == 0)
        out = torch.empty(world)
        dist.all_to_all_single(out, torch.arange(float(world)) + 10 * rank)
    dist.barrier()  # the last all_to_all's output is complete on every rank past this
    assert torch.equal(t, torch.full((6,), float(world) ** 6)), t
    assert torch.equal(out, torch.full((world,), float(rank)) + 10 * torch.arange(float(world))), out

    def both(name, fn):  # the same call on the jacklring group and on gloo: bit-identical results
        ours, theirs = fn(None), fn(gloo)
        for a, b in zip(ours, theirs):
            assert a.dtype == b.dtype and torch.equal(a, b), (name, a, b)

    # Small integers: exact in every dtype, so gloo's arithmetic and the engine's agree bit for bit.
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8):
        def data(n, dtype=dtype):
            return ((torch.arange(n) * 7 + rank * 3) % 11).to(dtype)

        def gather_flat(g, data=data, dtype=dtype):
            out = torch.empty(world * 5, dtype=dtype)
            dist.all_gather_into_tensor(out, data(5), group=g)
            return [out]

        def gather_list(g, data=data, dtype=dtype):
            outs = [torch.empty(2, 3, dtype=dtype) for _ in range(world)]
            dist.all_gather(outs, data(6).view(2, 3), group=g)
            return outs

        def reduce_scatter(g, data=data, dtype=dtype):
            out = torch.empty(4, dtype=dtype)
            dist.reduce_scatter_tensor(out, data(4 * world), op=dist.ReduceOp.MAX, group=g)
            return [out]

        def broadcast(g, data=data):
            b = data(9)
            dist.broadcast(b, src=world - 1, group=g)
            return [b]

        def strided(g, data=data):
            s = data(12).view(3, 4).t()  # not contiguous
            dist.all_reduce(s, op=dist.ReduceOp.MIN, group=g)
            return [s]

        for name, fn in (("all_gather_into_tensor", gather_flat), ("all_gather", gather_list),
                         ("reduce_scatter_tensor", reduce_scatter), ("broadcast", broadcast), ("strided", strided)):
            both(f"{name} {dtype}", fn)
            calls = python_calls(lambda fn=fn: fn(None))  # every rank: the same ops in the same order
            assert calls == 0 or not native, f"native {name} ({dtype}) ran Python code"

    def coalesced(g):  # allreduce_coalesced (two dtypes), allgather_into_tensor / reduce_scatter coalesced
        import contextlib

        def batch():  # on gloo (no mixed dtypes in one coalesced call) the calls one by one
            return dist._coalescing_manager(group=g) if g is None else contextlib.nullcontext()
        a, b, c = torch.arange(5.0) + rank, torch.arange(3) * (rank + 1), torch.ones(2) * rank
        with batch():
            for x in (a, b, c):
                dist.all_reduce(x, group=g)
        outs = [torch.empty(world * 3), torch.empty(world * 2, dtype=torch.int32)]
        with batch():
            dist.all_gather_into_tensor(outs[0], torch.arange(3.0) + rank, group=g)
            dist.all_gather_into_tensor(outs[1], torch.arange(2, dtype=torch.int32) - rank, group=g)
        rs = [torch.empty(2), torch.empty(1)]
        with batch():
            dist.reduce_scatter_tensor(rs[0], torch.arange(2.0 * world) * (rank + 1), group=g)
            dist.reduce_scatter_tensor(rs[1], torch.arange(1.0 * world) - rank, group=g)
        return [a, b, c, *outs, *rs]
    both("coalesced", coalesced)

    # FSDP's all-gather: the input is this rank's slice of the output.
    flat = torch.zeros(world * 4)
    mine = flat[rank * 4:(rank + 1) * 4]
    mine.copy_(torch.arange(4.0) + rank)
    dist.all_gather_into_tensor(flat, mine)
    assert torch.equal(flat, torch.cat([torch.arange(4.0) + q for q in range(world)])), flat
    calls = python_calls(lambda: dist.barrier())
    assert calls == 0 or not native, "the native barrier ran Python code"

    # Asynchronous native ops: queued in order, completed on the communication thread.
    xs = [torch.full((1000,), float(rank + i)) for i in range(4)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    future = works[-1].get_future()
    for w in works:
        assert w.wait(datetime.timedelta(seconds=20))
        assert w.is_completed() and w.is_success() and w.exception() is None
    assert torch.equal(future.wait()[0], xs[-1])
    for i, x in enumerate(xs):
        assert torch.equal(x, torch.full((1000,), float(sum(q + i for q in range(world))))), (i, x[:3])

    # wait(timeout): the peers are late; the timeout ends the wait, not the op.
    late = torch.ones(3)
    if rank == 0:
        work = dist.all_reduce(late, async_op=True)
        started = time.monotonic()
        try:
            work.wait(datetime.timedelta(milliseconds=200))
        except dist.DistBackendError as exc:
            waited = time.monotonic() - started
            assert "rank 0" in str(exc) and "Timed out waiting 200ms" in str(exc), exc
            assert 0.15 < waited < 1.2, waited
        else:
            raise AssertionError("wait(timeout) returned while a peer had not called the all-reduce")
        assert not work.is_completed()
        assert work.wait(datetime.timedelta(seconds=20))
    else:
        time.sleep(1.5)
        dist.all_reduce(late)
    assert torch.equal(late, torch.full((3,), float(world))), late

    # DDP: bucket all-reduces (asynchronous, from torch's C++) overlap backward.
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)), bucket_cap_mb=0.01)
    for _ in range(3):
        model(torch.randn(16, 64) + rank).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    same = grads.clone()
    dist.broadcast(same, src=0, group=gloo)
    assert torch.equal(grads, same), "DDP's gradients differ between ranks"

    # The last check: an asynchronous mismatch reaches the Work and its future as the Python
    # group's error (it breaks the group).
    work = dist.all_reduce(torch.ones(4 + rank), async_op=True)
    try:
        work.wait(datetime.timedelta(seconds=20))
    except dist.DistBackendError as exc:
        assert f"rank {rank}" in str(exc) and "allreduce(SUM)" in str(exc), exc
        assert "mismatch" in str(exc) or "left the group" in str(exc), exc
    else:
        raise AssertionError("a mismatch was not detected")
    assert work.is_completed() and not work.is_success() and work.exception() is not None
    try:
        work.get_future().wait()
    except Exception as exc:  # noqa: BLE001  (torch re-raises the future's error as it is)
        assert "allreduce(SUM)" in str(exc), exc
    else:
        raise AssertionError("the future of a failed op completed")
    print("ALL OK")


if __name__ == "__main__":
    main()
