"""Adversarial checks of the public API (adapter.init + adapter.ops) on whatever backend the
launcher configured; one launch runs them all. Used by tests/test_jaccl_public_api.py and
tests/test_mpi_backend.py under `launcher --backend jaccl|jaccl-ring|mpi`.

Every check asserts exact results against values each rank computes itself; a failing check
prints `FAIL name: ...` and the rank exits 1. The last line is `DONE rank R of N`.
"""
from __future__ import annotations

import sys
import traceback

import ml_dtypes
import numpy as np
import torch

import adapter

BF16 = ml_dtypes.bfloat16
group = adapter.init(strict=True)
r, n = group.rank(), group.size()
failures: list[str] = []


def check(fn):
    try:
        fn()
    except Exception as exc:
        failures.append(fn.__name__)
        print(f"FAIL {fn.__name__}: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()
    return fn


def same(got, want, name: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    if got.dtype.kind in "fc" or got.dtype == BF16:
        ok = np.allclose(got.astype(np.complex128), want.astype(np.complex128), equal_nan=True, rtol=1e-2)
    else:
        ok = np.array_equal(got, want)
    assert ok, (name, got.ravel()[:6], want.ravel()[:6])


@check
def zero_d_inputs():
    same(adapter.all_sum(np.array(r + 1.0, np.float32)), np.array(n * (n + 1) / 2, np.float32), "0-d sum")
    assert adapter.all_sum(torch.tensor(float(r))).shape == ()
    if n > 1:  # a group of one returns its input unchanged (a 0-d stays 0-d)
        same(adapter.all_gather(np.array(r, np.int64)), np.arange(n, dtype=np.int64), "0-d gather")


@check
def empty_inputs():
    for shape in [(0,), (0, 3)]:
        x = np.zeros(shape, np.float32)
        same(adapter.all_sum(x), x, "empty sum")
        same(adapter.all_max(x), x, "empty max")
        same(adapter.all_gather(x), x, "empty gather")
        same(adapter.broadcast(x, n - 1), x, "empty broadcast")
        same(adapter.sum_scatter(x), x, "empty sum_scatter")


@check
def non_contiguous_inputs_are_never_modified():
    base = np.arange(40, dtype=np.float32).reshape(5, 8)
    mine = base + r
    x = mine[:, ::2]
    same(adapter.all_sum(x), sum(base[:, ::2] + k for k in range(n)), "strided sum")
    same(adapter.all_gather(x), np.concatenate([base[:, ::2] + k for k in range(n)]), "strided gather")
    same(adapter.broadcast(mine.T, 0), base.T, "transposed broadcast")
    same(mine, base + r, "input untouched")
    t = torch.arange(40, dtype=torch.float32).reshape(5, 8).t() + r
    before = t.clone()
    got = adapter.all_sum(t)
    assert torch.equal(t, before)
    assert torch.allclose(got, sum(torch.arange(40, dtype=torch.float32).reshape(5, 8).t() + k for k in range(n)))
    for count in (7, 100_000):  # one-step and block algorithms
        x = np.full(count * n, r + 1.0, np.float32)
        keep = x.copy()
        same(adapter.all_sum(x), np.full(count * n, n * (n + 1) / 2, np.float32), "large sum")
        same(adapter.sum_scatter(x), np.full(count, n * (n + 1) / 2, np.float32), "sum_scatter")
        same(x, keep, "large input untouched")


@check
def dtypes_and_uneven_counts():
    for dtype in [BF16, np.float16, np.complex64, np.uint64, np.int8, np.float64, np.float32]:
        for count in [1, 5, 1000, 65537, 70001]:
            pattern = np.arange(count) % 5
            want = sum(pattern + k for k in range(n)).astype(dtype)
            same(adapter.all_sum((pattern + r).astype(dtype)), want, f"sum {dtype} {count}")
            if np.dtype(dtype).kind != "c":
                same(adapter.all_max((pattern + r).astype(dtype)), (pattern + n - 1).astype(dtype), f"max {dtype}")
                same(adapter.all_min((pattern + r).astype(dtype)), pattern.astype(dtype), f"min {dtype}")
    flags = np.array([r == 0, True, False, r == 1])
    same(adapter.all_sum(flags), np.array([True, True, False, n > 1]), "bool sum")
    same(adapter.all_min(flags), np.array([n == 1, True, False, False]), "bool min")
    big = np.array([2**63 + r, 2**64 - 1 - r], np.uint64)
    same(adapter.all_max(big), np.array([2**63 + n - 1, 2**64 - 1], np.uint64), "uint64 max")
    assert adapter.all_sum(torch.ones(3, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert adapter.all_sum(torch.tensor([True, r == 0])).dtype == torch.bool
    blocks = np.arange(n * 3 * 5, dtype=np.int32).reshape(n * 3, 5)
    same(adapter.sum_scatter(blocks + r), (blocks * n + n * (n - 1) // 2)[r * 3:(r + 1) * 3], "2-d sum_scatter")


@check
def nan_propagates_through_max_and_min():
    for dtype in [np.float32, np.float64, np.float16, BF16]:
        for count in [3, 50_000]:
            x = np.ones(count, dtype)
            if r == n - 1:
                x[1] = np.nan
            if r == 0:
                x[2] = np.nan
            for name, fn in (("max", adapter.all_max), ("min", adapter.all_min)):
                got = np.asarray(fn(x), np.float64)
                assert np.isnan(got[1]) and np.isnan(got[2]) and got[0] == 1, (name, dtype, count, got[:3])


@check
def broadcast_from_every_root():
    for root in range(n):
        x = np.full(70_000, r, np.int32)
        same(adapter.broadcast(x, root), np.full(70_000, root, np.int32), f"broadcast root {root}")
        same(x, np.full(70_000, r, np.int32), "broadcast input untouched")
    adapter.barrier()


@check
def send_recv_between_every_pair_in_both_orders():
    for a in range(n):
        for b in range(n):
            if a != b and r in (a, b):
                msg = np.arange(10, dtype=np.float64) + 100 * a + b
                if r == a:
                    adapter.send(msg, b)
                else:
                    same(adapter.recv((10,), np.float64, a), msg, f"{a}->{b}")
    for a in reversed(range(n)):
        for b in reversed(range(n)):
            if a != b and r in (a, b):
                msg = torch.arange(300_000, dtype=torch.float32) + a  # several frames
                if r == a:
                    adapter.send(msg, b)
                else:
                    assert torch.equal(adapter.recv_like(msg, a), msg)
    last = n - 1
    if n > 2 and r == 0:  # first rank <-> last rank, a round trip
        adapter.send(np.array([1, 2, 3], np.int16), last)
        same(adapter.recv((3,), np.int16, last), np.array([4, 5, 6], np.int16), "reply")
    elif n > 2 and r == last:
        same(adapter.recv((3,), np.int16, 0), np.array([1, 2, 3], np.int16), "request")
        adapter.send(np.array([4, 5, 6], np.int16), 0)
    if n > 1 and r == 0:
        strided = np.arange(20, dtype=np.float32)[::2]
        adapter.send(strided, 1)
        same(strided, np.arange(20, dtype=np.float32)[::2], "send input untouched")
        adapter.send(np.array(5.0), 1)
        adapter.send(np.zeros(0, np.float32), 1)
    elif n > 1 and r == 1:
        same(adapter.recv((10,), np.float32, 0), np.arange(20, dtype=np.float32)[::2], "strided")
        same(adapter.recv((), np.float64, 0), np.array(5.0), "0-d message")
        same(adapter.recv((0,), np.float32, 0), np.zeros(0, np.float32), "empty message")
    adapter.barrier()


@check
def every_rank_sends_before_it_receives():
    """Symmetric exchange (each rank sends to every other, then receives): 2 MB messages are far
    above MPI's eager limit, where a blocking MPI_Send deadlocked until the deadline."""
    count = 500_000
    for peer in range(n):
        if peer != r:
            adapter.send(np.full(count, 10 * r + peer, np.float32), peer)
    for peer in range(n):
        if peer != r:
            same(adapter.recv((count,), np.float32, peer), np.full(count, 10 * peer + r, np.float32), f"from {peer}")
    adapter.barrier()


@check
def split_every_way():
    alone = group.split(r)
    assert (alone.size(), alone.rank()) == (1, 0)
    same(adapter.all_sum(np.ones(3), group=alone), np.ones(3), "alone")
    halves = group.split(r % 2, key=n - r)  # reversed order inside each half
    members = sorted((k for k in range(n) if k % 2 == r % 2), key=lambda k: n - k)
    assert (halves.size(), halves.rank()) == (len(members), members.index(r)), (halves.size(), halves.rank())
    same(adapter.all_gather(np.array([r], np.int64), group=halves), np.array(members, np.int64), "half gather")
    nested = halves.split(0)
    assert nested.size() == halves.size() and nested.rank() == halves.rank()
    same(adapter.all_sum(np.array([1.0]), group=nested), np.array([float(len(members))]), "nested sum")
    if nested.size() > 1 and nested.rank() == 0:
        adapter.send(np.array([7.0]), nested.size() - 1, group=nested)
    elif nested.size() > 1 and nested.rank() == nested.size() - 1:
        same(adapter.recv((1,), np.float64, 0, group=nested), np.array([7.0]), "nested p2p")
    odd = group.split(-5 if r == 0 else 3)  # a negative color is a color like any other
    same(adapter.all_sum(np.array([1]), group=odd), np.array([1 if r == 0 else n - 1]), "negative color")
    adapter.barrier()
    same(adapter.all_sum(np.array([1]), group=group), np.array([n]), "world after splits")


print(f"DONE rank {r} of {n} failures={failures}", flush=True)
sys.exit(1 if failures else 0)
