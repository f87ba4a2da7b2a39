"""One JACCL rank for tests/jaccl/test_jaccl_mesh.py: runs a scenario, checks its own results and writes
a JSON report (digests of results that must be bit-identical across ranks, caught errors).

usage: worker.py SCENARIO OUT_DIR   (environment: MLX_RANK, MLX_JACCL_COORDINATOR, MLX_IBV_DEVICES)
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time

import ml_dtypes
import numpy as np

from adapter.backends.base import ReduceOp
from adapter.backends.elements import reduce_many
from adapter.backends.jaccl import backend as jaccl
from adapter.errors import DistributedError, MismatchError, PeerError

BF16 = np.dtype(ml_dtypes.bfloat16)
SMALL, LARGE, MULTI_FRAME = 7, 20_000, 300_000  # elements: one-step, blocks, frames > 1 MiB

REDUCE_CASES = [
    (ReduceOp.SUM, np.float32), (ReduceOp.SUM, np.float16), (ReduceOp.SUM, BF16), (ReduceOp.SUM, np.int32),
    (ReduceOp.SUM, np.uint8), (ReduceOp.SUM, np.bool_), (ReduceOp.SUM, np.complex64), (ReduceOp.SUM, np.float64),
    (ReduceOp.PROD, np.int64), (ReduceOp.PROD, np.float64), (ReduceOp.MAX, np.float32), (ReduceOp.MAX, np.int8),
    (ReduceOp.MIN, np.float16), (ReduceOp.MIN, np.uint16), (ReduceOp.BAND, np.uint8), (ReduceOp.BOR, np.int64),
    (ReduceOp.BXOR, np.bool_), (ReduceOp.BXOR, np.int32),
]


POOL_CHUNK = 1 << 20    # elements a pool grows by, each chunk drawn from a seed of its own
POOL_SPREAD = 1 << 16   # inputs start at different offsets below this into their kind's pool
_pools: dict[str, np.ndarray] = {}


def _pool(kind: str, length: int) -> np.ndarray:
    """The first `length` elements of one deterministic random sequence per kind ("int": 0..4,
    "f32": standard normal in float32, "f64": in float64), the same in every process whatever
    lengths it asked for before: chunk i is drawn from seed i alone."""
    pool = _pools.get(kind)
    if pool is None:
        pool = np.empty(0, np.uint8 if kind == "int" else np.float32 if kind == "f32" else np.float64)
    if len(pool) < length:
        chunks = [pool]
        for i in range(len(pool) // POOL_CHUNK, -(-length // POOL_CHUNK)):
            rng = np.random.default_rng([i, len(kind)])
            if kind == "int":
                chunks.append(rng.integers(0, 5, POOL_CHUNK, dtype=np.uint8))
            else:
                chunks.append(rng.standard_normal(POOL_CHUNK, dtype=np.float32 if kind == "f32" else np.float64))
        pool = _pools[kind] = np.concatenate(chunks)
    return pool[:length]


def make(rank: int, tag: int, count: int, dtype) -> np.ndarray:
    """Deterministic per-rank data, so every rank can compute every other rank's input.

    Each rank makes every rank's input, up to tens of millions of elements per check. Drawing
    them was most of a large-message rank's CPU, so every input is a fresh copy of a window of
    one pool of random values per kind, at an offset set by (rank, tag): inputs of different
    ranks differ at every position, and no two windows line up with a block boundary."""
    dt = np.dtype(dtype)
    at = (rank * 7919 + tag * 104729) % POOL_SPREAD
    if dt == np.bool_:
        return (_pool("int", at + count)[at:] & 1).astype(np.bool_)
    if dt.kind in "iu":
        return _pool("int", at + count)[at:].astype(dt)
    if dt.kind == "c":
        values = _pool("f64", 2 * (at + count))[2 * at:]
        return (values[0::2] + 1j * values[1::2]).astype(dt)
    if dt.itemsize <= 4:  # float32, float16, bfloat16
        return _pool("f32", at + count)[at:].astype(dt)
    return _pool("f64", at + count)[at:].astype(dt)


def digest(arr: np.ndarray) -> str:
    return hashlib.sha256(arr.tobytes()).hexdigest()


def check_equal(name: str, got: np.ndarray, want: np.ndarray, exact: bool) -> None:
    if exact or got.dtype.kind in "biu":
        ok = got.tobytes() == want.astype(got.dtype).tobytes()
    else:
        wide = np.complex128 if got.dtype.kind == "c" else np.float64
        ok = np.allclose(got.astype(wide), want.astype(got.dtype).astype(wide), rtol=2e-2, atol=5e-2)
    if not ok:
        raise AssertionError(f"{name}: wrong result\n got {got[:8]}\nwant {want[:8]}")


def all_reduce_in_rank_order(b, nbytes: int) -> bool:
    """Whether b's all_reduce of nbytes reduces in rank order (bit-exact against reduce_many):
    the mesh does, except where the TCP mesh hands large ones of 3+ ranks to the ring order."""
    from adapter.backends.jaccl.algorithms import SHARED_LINK_RING_BYTES

    algorithms = b._algorithms
    chooser = getattr(algorithms, "chooser", None)
    if b.mode == "mesh" and chooser is not None and chooser.choose("all_reduce", nbytes) != "native":
        return False  # a log-latency schedule (adapter/backends/algorithms): its own fixed order
    mesh = getattr(algorithms, "mesh", algorithms)
    return b.mode == "mesh" and (getattr(mesh, "_ring", None) is None or nbytes < SHARED_LINK_RING_BYTES)


def run_ops(b, report: dict) -> None:
    r, n = b.rank(), b.size()
    exact = b.mode == "mesh"  # the mesh reduces in rank order exactly like reduce_many
    for tag, (op, dtype) in enumerate(REDUCE_CASES):
        for count in (SMALL, LARGE) if tag % 3 == 0 else (SMALL,):
            inputs = [make(q, tag, count, dtype) for q in range(n)]
            src = inputs[r].copy()
            dst = np.empty_like(src)
            b.all_reduce(src, dst, op)
            want = np.empty_like(src)
            reduce_many(want, inputs, op)
            name = f"all_reduce {op.name} {np.dtype(dtype)} x{count}"
            check_equal(name, dst, want, all_reduce_in_rank_order(b, src.nbytes))
            report["digests"][name] = digest(dst)
    # in place and larger than one frame (1 MiB)
    big = [make(q, 100, MULTI_FRAME, np.float32) for q in range(n)]
    buf = big[r].copy()
    b.all_reduce(buf, buf, ReduceOp.SUM)
    want = np.empty_like(buf)
    reduce_many(want, big, ReduceOp.SUM)
    check_equal("all_reduce in place multi-frame", buf, want, all_reduce_in_rank_order(b, buf.nbytes))
    report["digests"]["all_reduce in place multi-frame"] = digest(buf)

    for tag, (dtype, count) in enumerate([(np.float32, 5), (BF16, 3), (np.bool_, 9), (np.int64, MULTI_FRAME // 2)]):
        inputs = [make(q, 200 + tag, count, dtype) for q in range(n)]
        dst = np.empty(n * count, np.dtype(dtype))
        b.all_gather(inputs[r], dst)
        check_equal(f"all_gather {np.dtype(dtype)}", dst, np.concatenate(inputs), True)

    for tag, (op, dtype, block) in enumerate([(ReduceOp.SUM, np.float32, 4), (ReduceOp.MAX, np.int32, 3),
                                              (ReduceOp.SUM, np.float64, LARGE)]):
        inputs = [make(q, 300 + tag, n * block, dtype) for q in range(n)]
        dst = np.empty(block, np.dtype(dtype))
        b.reduce_scatter(inputs[r], dst, op)
        full = np.empty_like(inputs[0])
        reduce_many(full, inputs, op)
        check_equal(f"reduce_scatter {op.name}", dst, full[r * block:(r + 1) * block], exact)

    for root in range(n):
        for count in (6, LARGE):
            buf = make(r, 400 + root, count, np.float32)
            b.broadcast(buf, root)
            check_equal(f"broadcast root {root}", buf, make(root, 400 + root, count, np.float32), True)

    # back to back: a fast rank's next message often arrives together with the current one
    for i in range(200):
        x = np.array([r + i], np.int64)
        b.all_reduce(x, x, ReduceOp.SUM)
        assert x[0] == sum(q + i for q in range(n)), (i, x)
    b.barrier()
    report["ops"] = "ok"


def run_large(b, report: dict, key: str = "large") -> None:
    """Messages of several frames on the streaming reduction: element sizes that do not divide a
    frame, uneven blocks, in place (where a later rank's own part is also its output) and not.
    The mesh reduces in rank order (bit-exact against numpy in that order); the ring order, which
    the TCP mesh uses for large all_reduces of 3 or more ranks, only close to it."""
    r, n = b.rank(), b.size()
    exact_scatter = b.mode == "mesh"
    frame = b._transport.frame_bytes
    for tag, (op, dtype) in enumerate([(ReduceOp.SUM, np.complex128), (ReduceOp.SUM, np.float16),
                                       (ReduceOp.SUM, BF16), (ReduceOp.MAX, np.int8), (ReduceOp.PROD, np.float64)]):
        item = np.dtype(dtype).itemsize
        count = n * (2 * frame // item) + 2 * n + 1   # every block > two frames, blocks uneven
        inputs = [make(q, 600 + tag, count, dtype) for q in range(n)]
        want = np.empty_like(inputs[0])
        reduce_many(want, inputs, op)
        for in_place in (False, True):
            src = inputs[r].copy()
            dst = src if in_place else np.empty_like(src)
            b.all_reduce(src, dst, op)
            name = f"large all_reduce {op.name} {np.dtype(dtype)} x{count}{' in place' if in_place else ''}"
            check_equal(name, dst, want, all_reduce_in_rank_order(b, src.nbytes))
            report["digests"][name] = digest(dst)
        block = 2 * frame // item + 3
        inputs = [make(q, 650 + tag, n * block, dtype) for q in range(n)]
        full = np.empty_like(inputs[0])
        reduce_many(full, inputs, op)
        dst = np.empty(block, np.dtype(dtype))
        b.reduce_scatter(inputs[r], dst, op)
        check_equal(f"large reduce_scatter {op.name} {np.dtype(dtype)}", dst, full[r * block:(r + 1) * block],
                    exact_scatter)
    report[key] = "ok"


def run_large_mesh_order(b, report: dict) -> None:
    """run_large on the mesh's own large all_reduce (an RDMA mesh's), which the TCP mesh hands to
    the ring order with 3 or more ranks: kept under test over TCP."""
    from adapter.backends.jaccl.algorithms import MeshAlgorithms

    if b.mode == "mesh":
        b._algorithms = MeshAlgorithms(b._link, b.size())
    run_large(b, report, "large_mesh_order")


def run_broadcast(b, report: dict) -> None:
    """broadcast from every root at the scatter threshold's boundaries (and above one frame),
    against the root's numpy data; records how many bytes each root put on the wire."""
    from adapter.backends.jaccl.algorithms import BROADCAST_SCATTER_BYTES
    r, n = b.rank(), b.size()
    sent = {}
    for tag, (dtype, nbytes) in enumerate([(np.float32, BROADCAST_SCATTER_BYTES - 4),
                                           (np.float32, BROADCAST_SCATTER_BYTES),
                                           (np.int16, BROADCAST_SCATTER_BYTES + 2),
                                           (np.float64, 3 * (1 << 20) + 8 * 7),
                                           (BF16, 2 * 6 + 2)]):
        count = nbytes // np.dtype(dtype).itemsize
        for root in range(n):
            want = make(root, 700 + tag, count, dtype)
            buf = want.copy() if r == root else make(r, 750 + tag, count, dtype)
            before = b._transport.posted_bytes
            b.broadcast(buf, root)
            check_equal(f"broadcast {np.dtype(dtype)} x{count} from {root}", buf, want, True)
            if r == root:
                sent[str(nbytes)] = b._transport.posted_bytes - before
    report["broadcast_sent"] = sent
    report["broadcast"] = "ok"


def run_p2p_chain(b, report: dict) -> None:
    """Rank 0 receives from rank 2, then from rank 1; rank 1 sends rank 0 16 MB (more than any
    socket buffer) before it sends rank 2 what rank 2 waits for before sending rank 0. Rank 0
    must read rank 1's bytes ahead while it waits on rank 2, or all three wait forever."""
    r = b.rank()
    big = np.arange(4_000_000, dtype=np.float32)
    start = time.monotonic()
    if r == 0:
        got2, got1 = np.empty(3, np.int64), np.empty_like(big)
        b.recv(got2, 2)
        b.recv(got1, 1)
        assert list(got2) == [7, 8, 9] and np.array_equal(got1, big)
    elif r == 1:
        b.send(big, 0)
        b.send(np.array([1, 2, 3], np.int64), 2)
    elif r == 2:
        got = np.empty(3, np.int64)
        b.recv(got, 1)
        assert list(got) == [1, 2, 3]
        b.send(np.array([7, 8, 9], np.int64), 0)
    report["p2p_chain"] = time.monotonic() - start


def run_p2p(b, report: dict) -> None:
    """Every ordered pair of ranks exchanges a message, in one global order."""
    r, n = b.rank(), b.size()
    for src in range(n):
        for dst in range(n):
            if src == dst:
                continue
            count = 3 + src * n + dst
            if r == src:
                b.send(make(src, 500 + dst, count, np.int32), dst)
            elif r == dst:
                got = np.empty(count, np.int32)
                b.recv(got, src)
                check_equal(f"recv {src}->{dst}", got, make(src, 500 + dst, count, np.int32), True)
    # a burst of small messages queued before the receiver reads any of them
    if r == 0:
        for i in range(50):
            b.send(np.full(i + 1, i, np.int16), n - 1)
    elif r == n - 1:
        time.sleep(0.2)
        for i in range(50):
            got = np.empty(i + 1, np.int16)
            b.recv(got, 0)
            assert (got == i).all(), (i, got)
    report["p2p"] = "ok"


def run_split(b, report: dict) -> None:
    r, n = b.rank(), b.size()
    color = r % 2
    sub = b.split(color, -r)   # reversed order inside each color
    members = sorted((q for q in range(n) if q % 2 == color), key=lambda q: -q)
    assert sub.rank() == members.index(r) and sub.size() == len(members), (sub.rank(), sub.size(), members)
    got = np.empty(sub.size(), np.int64)
    sub.all_gather(np.array([r], np.int64), got)
    assert list(got) == members, (list(got), members)
    x = np.array([r + 1.0], np.float64)
    sub.all_reduce(x, x, ReduceOp.SUM)
    assert x[0] == sum(q + 1.0 for q in members), x
    # the parent still works after the split
    y = np.ones(3, np.float32)
    b.all_reduce(y, y, ReduceOp.SUM)
    assert (y == n).all()
    report["split_shared_memory"] = getattr(sub, "shared_memory", False)  # a group of one has none
    sub.close()
    report["split"] = members


def run_mismatch(b, report: dict) -> None:
    r = b.rank()
    try:
        if r == 0:
            b.all_reduce(np.ones(4, np.float32), np.empty(4, np.float32), ReduceOp.SUM)
        elif r == 1:
            b.all_gather(np.ones(4, np.float32), np.empty(4 * b.size(), np.float32))
        else:
            b.all_reduce(np.ones(4, np.float32), np.empty(4, np.float32), ReduceOp.SUM)
        report["error"] = None
    except (MismatchError, PeerError) as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"


def run_recv_mismatch(b, report: dict) -> None:
    r = b.rank()
    try:
        if r == 0:
            b.send(np.ones(4, np.float32), 1)
        elif r == 1:
            b.recv(np.empty(8, np.float32), 0)
        report["error"] = None
    except MismatchError as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"


def run_dead_peer(b, report: dict) -> None:
    if b.rank() == 1:
        os._exit(0)   # dies without a word
    start = time.monotonic()
    try:
        b.all_reduce(np.ones(4, np.float32), np.empty(4, np.float32), ReduceOp.SUM)
        report["error"] = None
    except PeerError as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["seconds"] = time.monotonic() - start


def run_api(b, report: dict) -> None:
    """The public API on top: adapter.init(backend="jaccl") and adapter.ops."""
    import adapter
    from adapter import ops
    group = adapter.init(backend="jaccl", strict=True)
    total = ops.all_sum(np.full(5, group.rank() + 1, np.float32), group=group)
    assert (total == sum(range(1, group.size() + 1))).all(), total
    report["api"] = group.backend_name


def run_second_thread(b, report: dict) -> None:
    """JACCL takes one operation at a time per group: while one thread waits in a recv, another
    thread's collective gets a DistributedError at once (no frame sent), and the group stays
    usable. Rank 1 sends late, so rank 0's recv is certainly waiting when its main thread calls."""
    if b.rank() == 0:
        got = {}

        def receive() -> None:
            buf = np.empty(4, np.float32)
            b.recv(buf, 1)
            got["value"] = buf.copy()

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        time.sleep(0.3)
        try:
            b.all_reduce(np.ones(4, np.float32), np.empty(4, np.float32), ReduceOp.SUM)
        except DistributedError as exc:
            assert "another thread runs an operation" in str(exc) and "split" in str(exc), str(exc)
        else:
            raise AssertionError("a second thread's all_reduce was accepted while a recv ran")
        thread.join(20)
        assert not thread.is_alive() and np.all(got["value"] == 7), got
    elif b.rank() == 1:
        time.sleep(1.0)
        b.send(np.full(4, 7, np.float32), 0)
    x = np.ones(4, np.float32)
    b.all_reduce(x, x, ReduceOp.SUM)
    assert np.all(x == b.size()), x
    report["second_thread"] = "ok"


SCENARIOS = {"second_thread": run_second_thread, "api": run_api, "ops": run_ops, "large": run_large,
             "large_mesh_order": run_large_mesh_order, "broadcast": run_broadcast, "p2p_chain": run_p2p_chain,
             "p2p": run_p2p, "split": run_split, "mismatch": run_mismatch, "recv_mismatch": run_recv_mismatch,
             "dead_peer": run_dead_peer}


def main() -> None:
    scenarios, out_dir = sys.argv[1].split(","), sys.argv[2]
    b = jaccl.create()
    report = {"rank": b.rank(), "size": b.size(), "mode": b.mode, "transport": b.transport_kind, "digests": {},
              "families": sorted({s.sock.family.name for s in b._transport._by_fd.values()}),
              "shared_memory": b.shared_memory}
    for name in scenarios:
        SCENARIOS[name](b, report)
    with open(os.path.join(out_dir, f"rank{b.rank()}.json"), "w") as fh:
        json.dump(report, fh)
    if "dead_peer" not in scenarios:
        b.close()


if __name__ == "__main__":
    main()
