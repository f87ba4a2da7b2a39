"""The C++ c10d Backend (JACKLRING_TORCH_NATIVE=1) against gloo's results and the Python group's
errors: what torch dispatches to it, what it hands to the Python group, and how its Works
behave for Python and for torch's C++ (DDP)."""
from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist
from common import extra, init

import adapter
import adapter.torch_backend
from adapter.torch_backend.cpp_backend import python_group
from adapter.torch_backend.process_group import JacklringProcessGroup


def python_calls(call) -> int:
    """Python functions of adapter/ entered during call()."""
    here = adapter.__file__.rsplit("/", 1)[0]
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_filename.startswith(here):
            count += 1
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return count


def main() -> None:
    rank, world = init()
    pg = dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cpu"))
    assert type(backend).__name__ == "JacklringBackend", type(backend)
    assert isinstance(python_group(pg, JacklringProcessGroup), JacklringProcessGroup)
    assert pg.name() == "jacklring", pg.name()  # C++ readers (DDP's logging data) see this name
    gloo = dist.new_group(backend="gloo")
    native = backend.native  # the ranks share memory: synchronous all-reduces run in C++
    assert native == (extra() != ["no-shm"]), (native, extra())
    if native:
        t = torch.ones(5)
        dist.all_reduce(t)  # the first after ops handed to Python reads the group's sequence number
        t = torch.ones(5)
        assert python_calls(lambda: dist.all_reduce(t)) == 0, "the native all-reduce ran Python code"
        assert torch.equal(t, torch.full((5,), float(world)))

    def both(fn):  # the same call on the jacklring group and on gloo: bit-identical results
        ours, theirs = fn(None), fn(gloo)
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), (a, b)

    for dtype in (torch.float32, torch.float64, torch.int32):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
            def reduce(group, dtype=dtype, op=op):
                t = (torch.arange(7) % 3 + rank + 1).to(dtype)
                dist.all_reduce(t, op=op, group=group)
                return [t]
            both(reduce)

    def gather(group):
        out = torch.empty(world * 5)
        dist.all_gather_into_tensor(out, torch.arange(5.0) + rank, group=group)
        outs = [torch.empty(3) for _ in range(world)]
        dist.all_gather(outs, torch.full((3,), float(rank)), group=group)
        return [out, *outs]
    both(gather)

    def scatter(group):
        out = torch.empty(4)
        dist.reduce_scatter_tensor(out, torch.arange(4.0 * world) * (rank + 1), group=group)
        b = torch.arange(6.0) * (rank + 2)
        dist.broadcast(b, src=world - 1, group=group)
        return [out, b]
    both(scatter)

    # Coalesced and asynchronous calls: Works are C++ objects over the Python ones.
    tensors = [torch.ones(3) * (rank + 1), torch.ones(2) * (rank + 1)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for w in works:
        assert w.wait(datetime.timedelta(seconds=30))
        assert w.is_completed() and w.is_success()
    future = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    assert torch.equal(future.wait()[0], torch.full((4,), float(world)))
    expected = float(sum(range(1, world + 1)))
    assert all(torch.equal(t, torch.full_like(t, expected)) for t in tensors), tensors

    # Issue order across the two paths: a queued asynchronous all-reduce (Python's thread)
    # completes before a synchronous one on the same tensor (native) starts.
    t = torch.ones(1000)
    work = dist.all_reduce(t, async_op=True)
    dist.all_reduce(t)
    work.wait()
    assert torch.equal(t, torch.full_like(t, float(world * world))), t[:4]
    strided = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    dist.all_reduce(strided, op=dist.ReduceOp.MAX)
    assert torch.equal(strided, torch.arange(12.0).reshape(3, 4).t()), strided

    # Point to point and the barrier go to the Python group too.
    if rank == 0:
        dist.send(torch.arange(3.0), dst=1, tag=7)
    elif rank == 1:
        got = torch.empty(3)
        dist.recv(got, src=0, tag=7)
        assert torch.equal(got, torch.arange(3.0)), got
    dist.barrier()
    adapter.torch_backend.monitored_barrier(timeout=datetime.timedelta(seconds=30))  # routed to the Python group

    # Argument errors are the Python group's own, with its message.
    try:
        dist.all_gather_into_tensor(torch.empty(world * 5 + 1), torch.empty(5))
    except ValueError as exc:
        assert "jacklring all_gather_into_tensor" in str(exc), exc
    else:
        raise AssertionError("a wrong output size was accepted")

    # DDP: bucket all-reduces from torch's C++ (asynchronous), futures read by the reducer.
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    for _ in range(3):
        model(torch.randn(16, 8) + rank).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    mine = grads.clone()
    dist.broadcast(grads, src=0)
    assert torch.equal(grads, mine), "DDP's gradients differ between ranks"
    if native:  # the last check: a mismatch breaks the group, as on the Python path
        try:
            dist.all_reduce(torch.ones(4 + rank))
        except dist.DistBackendError as exc:
            assert f"rank {rank}" in str(exc) and "allreduce(SUM)" in str(exc), exc
            assert "mismatch" in str(exc) or "left the group" in str(exc), exc
        else:
            raise AssertionError("a mismatch was not detected")
    dist.destroy_process_group()
    print("ALL OK")


if __name__ == "__main__":
    main()
