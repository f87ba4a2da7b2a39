"""The Work / Future contract of c10d's own backends (docs/torch.md), checked op by op.

argv extra: MODE [BACKEND]
  success   >= 1000 async ops of every kind per rank; after each wait(): the future is done,
            every query agrees with it, its value is the list of output tensors, callbacks ran
            or run and see the value, C++ sees a successful future. Prints
            "NOT DONE AFTER WAIT: k of n".
  mismatch  ranks issue all_reduces of different sizes: MismatchError on both ranks.
  deadline  group deadline 2 s, rank 1 is 4 s late: rank 0 fails with torch's "Timed out".
  death     rank 1 dies by SIGKILL with an irecv and an all_reduce of rank 0 pending.
For the error modes rank 0 checks every invariant on the failed Work (and rank 1 too for
mismatch) and prints "ERROR CONTRACT OK <kind>".
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from common import init
from torch._C._distributed_c10d import _create_work_from_future

from adapter.errors import MismatchError

MODE = sys.argv[4]
BACKEND = sys.argv[5] if len(sys.argv) > 5 else "jacklring"
P2P_FUTURES = BACKEND != "gloo"


def cpp_sees_success(future) -> bool:
    """What C++ callers (DDP's reducer) see: c10d wraps the same ivalue::Future."""
    return _create_work_from_future(future).is_success()


class Callbacks:
    """Counts then() callbacks and what they saw."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values = 0
        self.errors: list[str] = []

    def callback(self, fut):
        try:
            value = fut.value()
        except Exception as exc:
            with self.lock:
                self.errors.append(str(exc))
            raise
        with self.lock:
            self.values += 1
        return value


def has_future(work) -> bool:
    try:
        work.get_future()
    except RuntimeError:
        return False
    return True


def check_success(work, outputs: list[torch.Tensor], callbacks: Callbacks, stats: dict) -> None:
    future = work.get_future()
    work.wait()
    stats["ops"] += 1
    if not future.done():
        stats["not_done"] += 1
        future.wait()  # let the remaining checks describe the settled state
    assert work.is_completed() and work.is_success(), work
    assert work.exception() is None
    value = future.value()
    if BACKEND == "gloo":  # gloo's values differ per op (e.g. all_gather_into_tensor): only count
        return
    assert isinstance(value, list) and len(value) == len(outputs), (value, outputs)
    assert all(v is o for v, o in zip(value, outputs)), "the future's value is not the output tensors"
    assert all(r is o for r, o in zip(work.result(), outputs))
    if stats["ops"] % 50 == 0:
        assert cpp_sees_success(future)


def run_success(rank: int, world: int) -> None:
    peer = 1 - rank
    stats = {"ops": 0, "not_done": 0, "callbacks": 0, "without_future": 0}
    callbacks = Callbacks()
    rounds = 90
    for i in range(rounds):
        pending = []

        def issue(work, outputs):
            if BACKEND == "gloo" and not has_future(work):
                stats["without_future"] += 1  # gloo leaves getFuture unimplemented for some ops
                pending.append((work, None))
                return
            work.get_future().then(callbacks.callback)  # added while (probably) pending
            stats["callbacks"] += 1
            pending.append((work, outputs))

        t = torch.full((64,), float(rank + i))
        issue(dist.all_reduce(t, async_op=True), [t])
        b = torch.full((16,), float(rank))
        issue(dist.broadcast(b, src=i % world, async_op=True), [b])
        gathered = [torch.empty(8) for _ in range(world)]
        issue(dist.all_gather(gathered, torch.full((8,), float(rank)), async_op=True), gathered)
        flat = torch.empty(8 * world)
        issue(dist.all_gather_into_tensor(flat, torch.full((8,), float(rank)), async_op=True), [flat])
        rs = torch.empty(4)
        issue(dist.reduce_scatter_tensor(rs, torch.ones(4 * world), async_op=True), [rs])
        coalesced = [torch.ones(3), torch.ones(5)]
        world_pg = dist.distributed_c10d._get_default_group()  # all_reduce_coalesced returns a future
        issue(world_pg.allreduce_coalesced(coalesced, dist.AllreduceCoalescedOptions()), coalesced)
        a2a = torch.empty(2 * world)
        issue(dist.all_to_all_single(a2a, torch.arange(2 * world, dtype=torch.float32), async_op=True), [a2a])
        issue(dist.barrier(async_op=True), [])
        got = torch.empty(32)
        ops = [dist.P2POp(dist.isend, torch.full((32,), float(rank)), peer, tag=i),
               dist.P2POp(dist.irecv, got, peer, tag=i)]
        batch = dist.batch_isend_irecv(ops)
        sent = torch.full((16,), float(rank))
        recvd = torch.empty(16)
        if rank == 0:
            p2p = [(dist.isend(sent, peer, tag=1000 + i), [sent]), (dist.irecv(recvd, peer, tag=2000 + i), [recvd])]
        else:
            p2p = [(dist.irecv(recvd, peer, tag=1000 + i), [recvd]), (dist.isend(sent, peer, tag=2000 + i), [sent])]
        for work, outputs in pending:
            if outputs is None:
                work.wait()
                stats["ops"] += 1
            else:
                check_success(work, outputs, callbacks, stats)
        for work, outputs in p2p + [(w, None) for w in batch]:
            if P2P_FUTURES:
                check_success(work, outputs if outputs is not None else work.result(), callbacks, stats)
            else:  # gloo's send/recv Works have no future (Work::getFuture not implemented)
                work.wait()
                stats["ops"] += 1
                assert work.is_completed() and work.is_success()
        assert torch.equal(got, torch.full((32,), float(peer))), got
        assert torch.equal(recvd, torch.full((16,), float(peer))), recvd
        assert torch.equal(t, torch.full((64,), float(2 * i + 1))), t
    # A callback that issues a new collective and waits for it (PowerSGD) must not deadlock
    # (gloo runs callbacks on its worker threads; it hung here in our runs).
    if BACKEND != "gloo":
        check_nested_collectives(world)
    deadline = time.monotonic() + 10  # callbacks added before completion run on completion threads
    while callbacks.values < stats["callbacks"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not callbacks.errors, callbacks.errors[:3]
    assert callbacks.values == stats["callbacks"], (callbacks.values, stats)
    print(f"NOT DONE AFTER WAIT: {stats['not_done']} of {stats['ops']} "
          f"({stats['without_future']} without a future)", flush=True)
    assert stats["not_done"] == 0, stats


def check_nested_collectives(world: int) -> None:
    nested = []

    def issue_and_wait(fut):
        inner = torch.ones(4)
        dist.all_reduce(inner, async_op=True).get_future().wait()
        nested.append(inner.clone())
        return fut.value()

    chained = [dist.all_reduce(torch.ones(4), async_op=True).get_future().then(issue_and_wait) for _ in range(4)]
    torch.futures.wait_all(chained)
    assert len(nested) == 4 and all(torch.equal(n, torch.full((4,), float(world))) for n in nested), nested


def check_failed(work, kind: str, expected: list[str]) -> str:
    """Every invariant on a Work that failed; returns the error's message."""
    future = work.get_future()
    before = Callbacks()
    chained = future.then(before.callback)  # registered before completion (usually)
    try:
        work.wait()
    except Exception as exc:
        error = exc
    else:
        raise AssertionError(f"{kind}: wait() returned on a failed operation")
    message = str(error)
    for text in expected:
        assert text in message, f"{kind}: {text!r} not in {message!r}"
    assert isinstance(error, RuntimeError), type(error)
    assert future.done(), f"{kind}: the future is not done after wait() raised"
    assert work.is_completed() and not work.is_success(), f"{kind}: {work}"
    assert work.exception() is error, (work.exception(), error)
    try:
        work.result()
    except Exception as again:
        assert str(again) == message
    else:
        raise AssertionError(f"{kind}: result() did not raise")
    for read in (future.wait, future.value):
        try:
            read()
        except RuntimeError as exc:
            assert message.splitlines()[0] in str(exc), (str(exc), message)
        else:
            raise AssertionError(f"{kind}: the future holds a value instead of the error")
    assert not cpp_sees_success(future), f"{kind}: C++ sees a successful future"
    after = Callbacks()
    late = future.then(after.callback)  # registered after completion: runs inline
    for cb, fut in ((before, chained), (after, late)):
        deadline = time.monotonic() + 5
        while not cb.errors and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cb.values == 0 and len(cb.errors) == 1 and message.splitlines()[0] in cb.errors[0], cb.errors
        assert fut.done() and not cpp_sees_success(fut), f"{kind}: a chained future did not fail"
    return message


def run_error(rank: int, world: int) -> None:
    t = torch.ones(8)
    dist.all_reduce(t)  # the group works
    if MODE == "mismatch":
        work = dist.all_reduce(torch.ones(4 if rank == 0 else 8), async_op=True)
        message = check_failed(work, "mismatch", [f"rank {rank}", "allreduce"])
        if BACKEND == "jacklring":
            assert isinstance(work.exception(), MismatchError), type(work.exception())
        print(f"ERROR CONTRACT OK mismatch: {message.splitlines()[0]}", flush=True)
        os._exit(0)
    if rank == 1:
        if MODE == "death":
            time.sleep(0.5)  # rank 0 posts its irecv and all_reduce first
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(4)
        try:
            dist.all_reduce(torch.ones(8))
        except Exception as exc:
            print(f"rank 1 late collective raised: {str(exc).splitlines()[0]}", flush=True)
        os._exit(0)
    if MODE == "death":
        recv = dist.irecv(torch.empty(4), 1, tag=7)
        work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
        message = check_failed(work, "death", ["rank 0", "rank 1", "allreduce"])
        recv_message = check_failed(recv, "death (irecv)", ["rank 0", "rank 1", "recv"])
        print(f"ERROR CONTRACT OK death: {message.splitlines()[0]} | {recv_message.splitlines()[0]}", flush=True)
    else:
        start = time.monotonic()
        work = dist.all_reduce(torch.ones(8), async_op=True)
        message = check_failed(work, "deadline", ["rank 0", "allreduce", "Timed out"])
        assert isinstance(work.exception(), TimeoutError)
        assert isinstance(work.exception(), dist.DistBackendError)
        print(f"ERROR CONTRACT OK deadline after {time.monotonic() - start:.2f} s: {message.splitlines()[0]}",
              flush=True)
    os._exit(0)  # skip destroy: the peer is gone or late


rank, world = init(timeout_s=2.0 if MODE == "deadline" else 30.0, backend=BACKEND)
if MODE == "success":
    run_success(rank, world)
    dist.destroy_process_group()
    print("futures ALL OK", flush=True)
else:
    run_error(rank, world)
