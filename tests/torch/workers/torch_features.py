"""torch.distributed features that gloo offers and jacklring must too (3 ranks unless noted).

argv extra: MODE[,MODE...] (run in order on one group; monitored, which leaves failed barriers
behind, only alone)
  anysource  recv / irecv from any source (src=None): the sender is reported, messages that
             arrived before the recv was posted are taken, directed recvs keep working after.
  monitored  adapter.torch_backend.monitored_barrier: passes when all arrive; names the missing
             rank (the first, or all with wait_all_ranks) on rank 0; the others time out; rank 0
             blames itself when its timeout is spent before it waits (as gloo).
  batch      batch_isend_irecv in a ring and in both directions; every future done.
  join       DDP join() with uneven inputs (2+ ranks), dividing by the initial world size and by
             the ranks still training: parameters equal gloo's.
Prints "<MODE> OK" after each.
"""
from __future__ import annotations

import datetime
import gc
import sys
import time

import torch
import torch.distributed as dist
from common import init
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import adapter.torch_backend

MODES = sys.argv[4].split(",")
assert "monitored" not in MODES or MODES == ["monitored"], "monitored runs in a launch of its own"
rank, world = init(timeout_s=20.0)


def anysource() -> None:
    if rank == 0:
        senders = set()
        for _ in range(world - 1):
            t = torch.empty(4)
            src = dist.recv(t)  # src=None
            assert torch.equal(t, torch.full((4,), float(src))), (src, t)
            senders.add(src)
        assert senders == set(range(1, world)), senders
        time.sleep(1.0)  # the next messages arrive before the recvs are posted (stashed)
        pg = dist.distributed_c10d._get_default_group()
        works = [(pg.recv_anysource([torch.empty(4)], 5)) for _ in range(world - 1)]
        seen = set()
        for work in works:
            work.wait()
            assert work.get_future().done() and work.is_success()
            src = work.source_rank()
            value = work.result()[0]
            assert torch.equal(value, torch.full((4,), 10.0 + src)), (src, value)
            seen.add(src)
        assert seen == set(range(1, world)), seen
        for src in reversed(range(1, world)):  # directed recvs after any-source ones
            t = torch.empty(2)
            dist.recv(t, src=src, tag=9)
            assert torch.equal(t, torch.full((2,), -float(src))), t
    else:
        time.sleep(0.2 * rank)
        dist.send(torch.full((4,), float(rank)), dst=0)
        dist.send(torch.full((4,), 10.0 + rank), dst=0, tag=5)
        dist.send(torch.full((2,), -float(rank)), dst=0, tag=9)
    dist.barrier()


def expect_raise(text: str, **kwargs) -> float:
    start = time.monotonic()
    try:
        adapter.torch_backend.monitored_barrier(**kwargs)
    except RuntimeError as exc:
        assert text in str(exc), (text, str(exc))
        print(f"rank {rank} raised after {time.monotonic() - start:.2f} s: {str(exc).splitlines()[0]}", flush=True)
        return time.monotonic() - start
    raise AssertionError(f"rank {rank}: monitored_barrier did not raise ({text!r} expected)")


def monitored() -> None:
    adapter.torch_backend.monitored_barrier()  # everyone arrives
    adapter.torch_backend.monitored_barrier(dist.group.WORLD, datetime.timedelta(seconds=5))
    timeout = datetime.timedelta(seconds=1)
    late = world - 1
    if rank == 0:
        elapsed = expect_raise(f"Rank {late} failed to pass monitoredBarrier", timeout=timeout)
        assert 0.9 < elapsed < 3, elapsed
    elif rank != late:
        expect_raise(f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting "
                     "for send/recv from rank 0", timeout=timeout)
    time.sleep(1.5)  # rank `late` skipped that one; all meet again through the store
    dist.distributed_c10d._store_based_barrier(rank, dist.distributed_c10d._get_default_store(), "mb", world,
                                               datetime.timedelta(seconds=20))
    if rank == 0:
        missing = ", ".join(str(q) for q in range(1, world))
        expect_raise(f"Ranks {missing} failed to pass monitoredBarrier", timeout=timeout, wait_all_ranks=True)
        # No time left before the first wait: gloo blames rank 0 itself, not the rank it would wait for.
        expect_raise("Rank 0 timed out in monitoredBarrier after 0 ms", timeout=datetime.timedelta(0))


def batch() -> None:
    right, left = (rank + 1) % world, (rank - 1) % world
    for i in range(50):
        got_left, got_right = torch.empty(8), torch.empty(8)
        ops = [dist.P2POp(dist.isend, torch.full((8,), float(rank * 100 + i)), right),
               dist.P2POp(dist.irecv, got_left, left),
               dist.P2POp(dist.isend, torch.full((8,), float(-rank - i)), left, tag=3),
               dist.P2POp(dist.irecv, got_right, right, tag=3)]
        works = dist.batch_isend_irecv(ops)
        for work in works:
            work.wait()
            assert work.get_future().done() and work.is_completed() and work.is_success()
        assert torch.equal(got_left, torch.full((8,), float(left * 100 + i))), got_left
        assert torch.equal(got_right, torch.full((8,), float(-right - i))), got_right


def join() -> None:
    gloo = dist.new_group(backend="gloo")

    def train(group, divide_by_initial_world_size: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), process_group=group,
                    bucket_cap_mb=0.001)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        with model.join(divide_by_initial_world_size=divide_by_initial_world_size):
            for _ in range(3 + 2 * rank):  # uneven: every rank has a different number of batches
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)), torch.randn(4, 2, generator=g))
                # The forward pass handed its join all-reduce to the reducer (C++), which waits
                # for it in backward when dividing by the ranks still training: give that
                # all-reduce time to complete and Python time to drop its Work first.
                time.sleep(0.05)
                gc.collect()
                loss.backward()
                opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for divide_by_initial in (True, False):
        ours, theirs = train(dist.group.WORLD, divide_by_initial), train(gloo, divide_by_initial)
        for a, b in zip(ours, theirs):  # 3-rank sums round differently in a ring and in gloo
            assert torch.allclose(a, b, rtol=0, atol=1e-6), \
                f"rank {rank} divide_by_initial_world_size={divide_by_initial}: max |jacklring - gloo| = " \
                f"{(a - b).abs().max().item()}"
        gathered = [torch.empty_like(ours[0]) for _ in range(world)]
        dist.all_gather(gathered, ours[0])
        assert all(torch.equal(g, ours[0]) for g in gathered), "ranks disagree after join"


for mode in MODES:
    {"anysource": anysource, "monitored": monitored, "batch": batch, "join": join}[mode]()
    print(f"{mode} OK", flush=True)
if MODES != ["monitored"]:
    dist.destroy_process_group()
