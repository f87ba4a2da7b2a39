"""Inline execution (docs/torch.md, "Execution model"): a synchronous collective runs on the
calling thread and is complete when it returns; async ones keep the communication thread and
issue order; a .then callback that issues collectives works before and after completion."""
from __future__ import annotations

import os
import sys
import threading
import weakref

import torch
import torch.distributed as dist
from common import init

import adapter


def helper_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.endswith("-comm") or "-complete" in t.name)


def torch_backend_calls(call) -> int:
    """Python calls made in adapter/ outside its backends during call()."""
    here = os.path.dirname(adapter.__file__)
    backends = os.path.join(here, "backends") + os.sep
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(here) and not name.startswith(backends):
            count += 1
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return count


def short_paths(rank: int, world: int) -> None:
    """Every common synchronous op on plain CPU tensors takes the short path (inline.py): few
    Python calls, right results for every reduce op, and the general path's refusals intact."""
    R = dist.ReduceOp
    ops = {
        "all_reduce MAX": lambda: dist.all_reduce(torch.ones(3), op=R.MAX),
        "all_reduce AVG": lambda: dist.all_reduce(torch.ones(3), op=R.AVG),
        "broadcast": lambda: dist.broadcast(torch.ones(3), 0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(3 * world), torch.ones(3)),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3 * world)),
        "barrier": lambda: dist.barrier(),
    }
    for name, call in ops.items():
        call()
        calls = torch_backend_calls(call)
        # 6-13 here (two tensors' views at most); the general paths made 12-31.
        assert calls <= 14, f"{name} made {calls} Python calls in adapter/"
    for op, expected in ((R.SUM, sum(range(1, world + 1))), (R.MAX, world), (R.MIN, 1),
                         (R.PRODUCT, float(torch.arange(1, world + 1).prod())), (R.AVG, (world + 1) / 2)):
        x = torch.full((5,), float(rank + 1))
        dist.all_reduce(x, op=op)
        assert torch.equal(x, torch.full((5,), float(expected))), (op, x)
        out = torch.empty(2)
        dist.reduce_scatter_tensor(out, torch.full((2 * world,), float(rank + 1)), op=op)
        assert torch.equal(out, torch.full((2,), float(expected))), (op, out)
    ints = torch.full((4,), 7 + rank, dtype=torch.int64)
    dist.all_reduce(ints, op=R.AVG)  # truncated toward zero, as NCCL does
    assert torch.equal(ints, torch.full((4,), (7 * world + world * (world - 1) // 2) // world)), ints
    bits = torch.full((4,), 1 << rank, dtype=torch.int32)
    dist.all_reduce(bits, op=R.BOR)
    assert torch.equal(bits, torch.full((4,), (1 << world) - 1, dtype=torch.int32)), bits
    try:
        dist.all_reduce(torch.ones(2), op=R.BAND)
    except ValueError as exc:
        assert "BAND" in str(exc), exc
    else:
        raise AssertionError("BAND on a float tensor was accepted")
    data = torch.full((3,), float(rank))
    dist.broadcast(data, world - 1)
    assert torch.equal(data, torch.full((3,), float(world - 1))), data
    # FSDP gathers into the output from a slice of it: the general path copies the input first.
    whole = torch.zeros(2 * world)
    whole[2 * rank:2 * rank + 2] = rank
    dist.all_gather_into_tensor(whole, whole[2 * rank:2 * rank + 2])
    assert torch.equal(whole, torch.arange(world).repeat_interleave(2).float()), whole


def main() -> None:
    # The Python group's execution model (the C++ Backend's is tests/torch/workers/cpp_native_ops.py):
    # read when the group forms, so this part's group is the Python one whatever the default.
    os.environ["JACKLRING_TORCH_NATIVE"] = "0"
    rank, world = init()
    pg = dist.distributed_c10d._get_default_group()
    t = torch.ones(4)
    for _ in range(10):
        dist.all_reduce(t)
    # A synchronous SUM of a plain CPU tensor takes the short path: 9 calls between torch's
    # dist.all_reduce and the backend and back (the general path made 27).
    counted = torch.ones(3)
    calls = torch_backend_calls(lambda: dist.all_reduce(counted))
    assert calls <= 10, f"dist.all_reduce made {calls} Python calls in adapter/"
    assert torch.equal(counted, torch.full((3,), float(world))), counted
    out = torch.empty(4 * world)
    dist.all_gather_into_tensor(out, t)
    dist.broadcast(t, 0)
    dist.barrier()
    assert torch.equal(t, torch.full((4,), float(world) ** 10)), t
    assert helper_threads() == [], f"synchronous collectives started threads: {helper_threads()}"
    short_paths(rank, world)
    assert helper_threads() == [], f"synchronous collectives started threads: {helper_threads()}"

    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    work = pg.allreduce([t], opts)
    assert work.is_completed() and work.get_future().done() and work.is_success(), work

    # Finished Works are handed out again only when nobody refers to them (work.py,
    # Executor._finished_work): one held, or whose future was asked for, keeps its op.
    a, b, c = torch.ones(2), torch.ones(3), torch.ones(4)
    held = pg.allreduce([a], opts)
    asked = pg.allreduce([b], opts)
    future = asked.get_future()
    del asked
    later = [pg.allreduce([c], opts) for _ in range(3)]
    assert held not in later and len({id(w) for w in later}) == 3, "a held Work was handed out again"
    assert held.result()[0] is a and future.wait()[0] is b and all(w.result()[0] is c for w in later)
    for _ in range(5):
        dist.all_reduce(c)  # dropped at once by torch: these may share one Work
    assert held.result()[0] is a and future.value()[0] is b and held.is_success()
    assert torch.equal(c, torch.full((4,), float(world) ** 8)), c
    # A big tensor's memory is not kept by a kept Work once the caller lets it go.
    big = torch.ones(1 << 19)
    gone = weakref.ref(big)
    dist.all_reduce(big)
    del big
    assert gone() is None, "a finished Work kept a 2 MiB tensor alive"

    # Issue order: a synchronous op behind a queued async one waits its turn.
    big = torch.ones(1 << 20)
    first = dist.all_reduce(big, async_op=True)
    dist.all_reduce(big)
    assert torch.equal(big, torch.full_like(big, float(world) ** 2)), big[:4]
    first.wait()
    assert any(name.endswith("-comm") for name in helper_threads()), "async op ran without the thread"

    # A callback added after completion runs at once on this thread and may issue collectives.
    y = torch.ones(2)
    done = dist.all_reduce(y, async_op=True)
    done.wait()
    chained = done.get_future().then(lambda f: (dist.all_reduce(f.value()[0]), f.value()[0])[1])
    assert torch.equal(chained.wait(), torch.full((2,), float(world) ** 2))

    # One added before completion runs on a completion thread, which runs the nested op inline.
    z = torch.ones(2)
    pending = dist.all_reduce(z, async_op=True)
    nested = pending.get_future().then(lambda f: (dist.all_reduce(f.value()[0]), f.value()[0])[1])
    assert torch.equal(nested.wait(), torch.full((2,), float(world) ** 2))
    pending.wait()

    # An error of an inline op surfaces from wait(), after the Work is complete.
    try:
        dist.all_reduce(torch.ones(3 + rank))  # ranks disagree on the size
    except RuntimeError as exc:
        assert "rank" in str(exc), exc
    else:
        raise AssertionError("mismatched sizes did not raise")
    print("INLINE ALL OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
