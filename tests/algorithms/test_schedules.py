"""The schedules of adapter/backends/algorithms, run by n threads over an in-memory PeerExchange
(a queue per ordered pair of ranks): every rank's result against numpy, and its bits against the
order the schedule promises (docs/algorithms.md), at every group size from 2 to 17. The same
schedules over real sockets: test_over_backends.py."""
from __future__ import annotations

import queue
import threading
from typing import Callable, Mapping

import numpy as np
import pytest
from alg_values import contribution, doubling_sum, linear_sum

from adapter.backends.algorithms import schedules
from adapter.backends.base import ReduceOp

SIZES = list(range(2, 18))


class QueuePeers:
    """A PeerExchange over queues: each message is copied on send and checked for its step and
    length on receipt, so a schedule whose two sides disagree fails here."""

    def __init__(self, rank: int, size: int, boxes: dict[tuple[int, int], queue.Queue]) -> None:
        self.rank, self.size = rank, size
        self._boxes = boxes
        self.steps: list[int] = []

    def sendrecv(self, step: int, sends: Mapping[int, memoryview], recvs: Mapping[int, memoryview]) -> None:
        self.steps.append(step)
        for peer, data in sends.items():
            assert peer != self.rank and 0 <= peer < self.size
            self._boxes[(self.rank, peer)].put((step, bytes(data)))
        for peer, view in recvs.items():
            got_step, data = self._boxes[(peer, self.rank)].get(timeout=10)
            assert got_step == step, f"rank {self.rank} step {step} got rank {peer}'s step {got_step}"
            assert len(data) == len(view), f"rank {self.rank} step {step}: {len(data)} bytes from {peer}, wants {len(view)}"
            view[:] = data


def run_ranks(n: int, body: Callable[[QueuePeers], object]) -> list:
    boxes = {(a, b): queue.Queue() for a in range(n) for b in range(n) if a != b}
    peers = [QueuePeers(r, n, boxes) for r in range(n)]
    results: list = [None] * n
    errors: list = []

    def one(r: int) -> None:
        try:
            results[r] = body(peers[r])
        except BaseException as exc:  # reported below with the rank
            errors.append((r, exc))

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), f"{n} ranks: a schedule hung"
    assert not errors, errors
    for box in boxes.values():
        assert box.empty(), f"{n} ranks: a message was sent that nobody received"
    return results


def test_the_values_make_order_visible() -> None:
    # Otherwise the determinism checks below could not fail.
    for n in (4, 5, 6, 7, 8):  # (3 folds into the same tree as the rank order)
        assert (linear_sum(n, 64) != doubling_sum(n, 64)).sum() >= 10


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("count", [1, 7, 64])
def test_recursive_doubling_all_reduce_is_the_documented_tree_on_every_rank(n: int, count: int) -> None:
    def body(x: QueuePeers) -> np.ndarray:
        src = contribution(x.rank, count)
        dst = np.empty_like(src)
        schedules.all_reduce_doubling(x, src, dst, ReduceOp.SUM, np.empty_like(src))
        return dst
    results = run_ranks(n, body)
    want = doubling_sum(n, count).tobytes()
    assert [r.tobytes() for r in results] == [want] * n


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("count", [1, 5, 100])
def test_rabenseifner_all_reduce_has_the_same_bits_on_every_rank(n: int, count: int) -> None:
    def body(x: QueuePeers) -> np.ndarray:
        src = contribution(x.rank, count)
        dst = np.empty_like(src)
        schedules.all_reduce_halving(x, src, dst, ReduceOp.SUM, np.empty_like(src))
        return dst
    results = run_ranks(n, body)
    exact = sum(contribution(r, count).astype(np.float64) for r in range(n))
    np.testing.assert_allclose(results[0], exact, rtol=1e-4, atol=1e-3)  # float32 sums of terms up to 4**4
    assert len({r.tobytes() for r in results}) == 1
    assert run_ranks(n, body)[0].tobytes() == results[0].tobytes()  # and from run to run


@pytest.mark.parametrize("n", SIZES)
def test_in_place_and_other_ops(n: int) -> None:
    def body(x: QueuePeers) -> tuple[np.ndarray, np.ndarray]:
        a = np.arange(10, dtype=np.int64) * (x.rank + 1)
        schedules.all_reduce_halving(x, a, a, ReduceOp.MAX, np.empty_like(a))
        b = np.full(3, x.rank + 1, np.int64)
        schedules.all_reduce_doubling(x, b, b, ReduceOp.PROD, np.empty_like(b))
        return a, b
    for a, b in run_ranks(n, body):
        assert a.tolist() == (np.arange(10) * n).tolist()
        assert b.tolist() == [int(np.prod(np.arange(1, n + 1)))] * 3


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("m", [1, 3])
def test_all_gather_and_reduce_scatter(n: int, m: int) -> None:
    def body(x: QueuePeers) -> tuple[np.ndarray, np.ndarray]:
        gathered = np.empty(n * m, np.int64)
        schedules.all_gather_doubling(x, np.arange(m) + 100 * x.rank, gathered)
        src = np.arange(n * m, dtype=np.float64) + x.rank
        mine = np.empty(m, np.float64)
        schedules.reduce_scatter_halving(x, src, mine, ReduceOp.SUM, np.empty_like(src), np.empty_like(src))
        return gathered, mine
    want = np.concatenate([np.arange(m) + 100 * r for r in range(n)])
    total = sum(np.arange(n * m, dtype=np.float64) + r for r in range(n))
    for r, (gathered, mine) in enumerate(run_ranks(n, body)):
        assert gathered.tolist() == want.tolist()
        assert mine.tolist() == total[r * m:(r + 1) * m].tolist()


@pytest.mark.parametrize("n", SIZES)
def test_broadcast_tree_from_every_root_and_barrier(n: int) -> None:
    for root in {0, 1, n - 1}:
        def body(x: QueuePeers, root: int = root) -> np.ndarray:
            buf = np.arange(5.0) + 10 * root if x.rank == root else np.zeros(5)
            schedules.broadcast_tree(x, buf, root)
            schedules.barrier_dissemination(x)
            return buf
        for buf in run_ranks(n, body):
            assert buf.tolist() == (np.arange(5.0) + 10 * root).tolist()


@pytest.mark.parametrize("n, steps", [(2, 1), (4, 2), (8, 3), (16, 4), (3, 3), (6, 4), (7, 4), (12, 5)])
def test_step_counts_are_logarithmic(n: int, steps: int) -> None:
    """log2(p) pair steps, plus the two fold steps when n is not a power of two."""
    def body(x: QueuePeers) -> int:
        a = np.ones(4, np.float32)
        schedules.all_reduce_doubling(x, a, a, ReduceOp.SUM, np.empty_like(a))
        return len(x.steps)
    assert max(run_ranks(n, body)) == steps
