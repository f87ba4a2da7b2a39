"""Run under mpirun (2 or 3 ranks): every op x every dtype of the MPI backend against numpy references.

Every rank runs the same sequence of collectives; a wrong result is recorded (not raised, so
the ranks stay in step) and the script exits 1 listing them. The last line of a rank that
passed everything is "rank R: N checks passed".
"""
from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np
import torch

import adapter
from adapter import ReduceOp
from adapter.backends.mpi import backend as mpi_backend

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [
    np.dtype(t)
    for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
              np.float16, BF16, np.float32, np.float64, np.complex64, np.complex128)
]
ALL_OPS = list(ReduceOp)
BOOL_REFERENCE = {
    ReduceOp.SUM: np.logical_or, ReduceOp.PROD: np.logical_and, ReduceOp.MAX: np.logical_or,
    ReduceOp.MIN: np.logical_and, ReduceOp.BAND: np.logical_and, ReduceOp.BOR: np.logical_or,
    ReduceOp.BXOR: np.logical_xor,
}
REFERENCE = {
    ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum,
    ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor,
}

failures: list[str] = []
checks = 0


def check(label: str, got, expected) -> None:
    global checks
    checks += 1
    got = np.asarray(got)
    if got.dtype != expected.dtype or got.shape != expected.shape or not np.array_equal(got, expected, equal_nan=False):
        failures.append(f"{label}: got {got!r} expected {expected!r}")


def valid_ops(dtype: np.dtype) -> list[ReduceOp]:
    ops = list(ALL_OPS)
    if dtype.kind not in "biu":
        ops = [op for op in ops if op not in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)]
    if dtype.kind == "c":
        ops = [op for op in ops if op not in (ReduceOp.MAX, ReduceOp.MIN)]
    return ops


def data(rank: int, dtype: np.dtype, n: int) -> np.ndarray:
    """Small integers (exact in float16/bfloat16 under sum and product of 3 ranks), distinct per rank."""
    rng = np.random.default_rng(1000 * rank + DTYPES.index(dtype) * 17 + n)
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(bool)
    low = 0 if dtype.kind in "ub" else -3
    values = rng.integers(low, 4, n)
    if dtype.kind == "c":
        return (values + 1j * rng.integers(-3, 4, n)).astype(dtype)
    return values.astype(dtype)


def wide(dtype: np.dtype):
    if dtype == BF16:  # ml_dtypes reports kind 'V'
        return np.float64
    return {"b": np.bool_, "i": np.int64, "u": np.uint64, "f": np.float64, "c": np.complex128}[dtype.kind]


def reference(parts: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    dtype = parts[0].dtype
    if dtype == np.bool_:
        acc = parts[0].copy()
        for part in parts[1:]:
            acc = BOOL_REFERENCE[op](acc, part)
        return acc
    acc = parts[0].astype(wide(dtype))
    for part in parts[1:]:
        acc = REFERENCE[op](acc, part.astype(wide(dtype)))
    return acc.astype(dtype)


def main() -> int:
    expected_size = int(sys.argv[1])
    assert "MLX_HOSTFILE" not in os.environ, "this check needs MLX_HOSTFILE unset"
    assert mpi_backend.probe() is None, mpi_backend.probe()

    # init(backend="any") under mpirun, with no ring/jaccl/nccl environment, picks MPI (ANY_ORDER).
    group = adapter.init()
    assert group.backend_name == "mpi", group
    assert adapter.init(backend="mpi") is group, "init(backend='mpi') must return the cached group"
    assert adapter.is_available("mpi")
    rank, size = group.rank(), group.size()
    assert size == expected_size, (size, expected_size)
    assert rank == int(os.environ["OMPI_COMM_WORLD_RANK"])

    n = 10
    for dtype in DTYPES:
        parts = [data(r, dtype, n) for r in range(size)]
        mine = parts[rank]
        for op in valid_ops(dtype):
            expected = reference(parts, op)
            check(f"all_reduce {op.name} {dtype}", adapter.all_reduce(mine, op), expected)
            # Backend level, in place (src is dst: MPI_IN_PLACE).
            buf = mine.copy()
            group.backend.all_reduce(buf, buf, op)
            check(f"in-place all_reduce {op.name} {dtype}", buf, expected)
            blocks = [data(r, dtype, n * size) for r in range(size)]
            scattered = adapter.reduce_scatter(blocks[rank], op)
            check(f"reduce_scatter {op.name} {dtype}", scattered, reference(blocks, op)[rank * n:(rank + 1) * n])
        for bad in set(ALL_OPS) - set(valid_ops(dtype)):
            try:
                adapter.all_reduce(mine, bad)
                failures.append(f"all_reduce {bad.name} {dtype} did not raise TypeError")
            except TypeError:
                pass
        check(f"all_sum {dtype}", adapter.all_sum(mine), reference(parts, ReduceOp.SUM))
        blocks = [data(r, dtype, n * size) for r in range(size)]
        check(f"sum_scatter {dtype}", adapter.sum_scatter(blocks[rank]),
              reference(blocks, ReduceOp.SUM)[rank * n:(rank + 1) * n])
        if dtype.kind != "c":
            check(f"all_max {dtype}", adapter.all_max(mine), reference(parts, ReduceOp.MAX))
            check(f"all_min {dtype}", adapter.all_min(mine), reference(parts, ReduceOp.MIN))
        check(f"all_gather {dtype}", adapter.all_gather(mine.reshape(2, 5)), np.concatenate(parts).reshape(2 * size, 5))
        for root in range(size):
            check(f"broadcast root {root} {dtype}", adapter.broadcast(mine, root), parts[root])
        # send/recv between every ordered pair, one pair at a time.
        for src in range(size):
            for dst in range(size):
                if src == dst:
                    continue
                if rank == src:
                    adapter.send(parts[src], dst)
                elif rank == dst:
                    check(f"recv {dtype} {src}->{dst}", adapter.recv((n,), dtype, src), parts[src])
        adapter.barrier()

    check_large_user_ops(group)
    check_torch(group)
    check_edge_cases(group)
    check_recv_mismatch(group)
    check_split(group)

    adapter.barrier()
    if failures:
        print(f"rank {rank}: {len(failures)} of {checks} checks FAILED:", *failures, sep="\n  ", flush=True)
        return 1
    chunked = f" (MPI calls cut at {mpi_backend.MAX_COUNT} elements)" if "JACKLRING_MPI_MAX_COUNT" in os.environ else ""
    print(f"rank {rank}: {checks} checks passed{chunked}", flush=True)
    return 0


def check_large_user_ops(group) -> None:
    """Large enough that Open MPI segments the message and pipelines the user-defined op."""
    rank, size = group.rank(), group.size()
    # With a tiny JACKLRING_MPI_MAX_COUNT (the chunked-path run) a smaller array keeps the call count sane.
    n = 300_001 if "JACKLRING_MPI_MAX_COUNT" not in os.environ else 1001
    for dtype in (np.dtype(np.float16), BF16):
        parts = [data(r, dtype, n) for r in range(size)]
        for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN):
            check(f"large all_reduce {op.name} {dtype}", adapter.all_reduce(parts[rank], op), reference(parts, op))
        m = n - n % size
        check(f"large sum_scatter {dtype}", adapter.sum_scatter(parts[rank][:m]),
              reference([p[:m] for p in parts], ReduceOp.SUM)[rank * (m // size):(rank + 1) * (m // size)])


def check_torch(group) -> None:
    rank, size = group.rank(), group.size()
    for dtype, tdtype in ((np.dtype(np.float32), torch.float32), (BF16, torch.bfloat16),
                          (np.dtype(np.float16), torch.float16), (np.dtype(np.int64), torch.int64),
                          (np.dtype(np.bool_), torch.bool), (np.dtype(np.complex64), torch.complex64),
                          (np.dtype(np.uint16), torch.uint16)):
        parts = [data(r, dtype, 6) for r in range(size)]
        mine = _to_torch(parts[rank], tdtype)
        out = adapter.all_sum(mine)
        assert isinstance(out, torch.Tensor) and out.dtype == tdtype, (type(out), getattr(out, "dtype", None))
        check(f"torch all_sum {tdtype}", _to_numpy(out, dtype), reference(parts, ReduceOp.SUM))
        gathered = adapter.all_gather(mine)
        check(f"torch all_gather {tdtype}", _to_numpy(gathered, dtype), np.concatenate(parts))
        if rank == 0:
            adapter.send(mine, 1)
            adapter.send(mine, 1)
        elif rank == 1:
            check(f"torch recv_like {tdtype}", _to_numpy(adapter.recv_like(mine, 0), dtype), parts[0])
            received = adapter.recv((6,), tdtype, 0)
            assert isinstance(received, torch.Tensor) and received.dtype == tdtype, received
            check(f"torch recv {tdtype}", _to_numpy(received, dtype), parts[0])
    # A 2-D tensor keeps its shape through sum_scatter.
    t = torch.arange(size * 4 * 3, dtype=torch.float32).reshape(size * 4, 3) * (rank + 1)
    out = adapter.sum_scatter(t)
    total = sum(range(1, size + 1))
    expected = (np.arange(size * 4 * 3, dtype=np.float32).reshape(size * 4, 3) * total)[rank * 4:(rank + 1) * 4]
    check("torch 2-D sum_scatter", out.numpy(), expected)


def _to_torch(arr: np.ndarray, tdtype) -> "torch.Tensor":
    if arr.dtype == BF16:
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    if arr.dtype == np.uint16:
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.uint16)
    return torch.from_numpy(arr.copy())


def _to_numpy(t: "torch.Tensor", dtype: np.dtype) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    if t.dtype == torch.uint16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def check_edge_cases(group) -> None:
    rank, size = group.rank(), group.size()
    empty = np.zeros(0, np.float32)
    check("empty all_sum", adapter.all_sum(empty), empty)
    # Values only: the shape of a reduced 0-d input is the ops layer's business, not the backend's.
    check("scalar all_sum", np.ravel(adapter.all_sum(np.float64(rank))), np.asarray([float(sum(range(size)))]))
    check("scalar all_gather", adapter.all_gather(np.int32(rank)), np.arange(size, dtype=np.int32))
    # Non-contiguous input: the ops layer makes it contiguous once; the result must still be right.
    base = np.arange(20, dtype=np.float32).reshape(4, 5) + rank
    check("non-contiguous all_sum", adapter.all_sum(base[:, ::2]),
          sum(np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2] + r for r in range(size)))
    # Backend-level: buffers are written in place, never replaced.
    dst = np.empty(4, np.int32)
    src = np.full(4, rank, np.int32)
    group.backend.all_reduce(src, dst, ReduceOp.SUM)
    check("backend all_reduce writes dst", dst, np.full(4, sum(range(size)), np.int32))
    check("backend all_reduce leaves src", src, np.full(4, rank, np.int32))


def check_recv_mismatch(group) -> None:
    """A recv of the wrong dtype or size raises MismatchError naming the peer; the stream stays usable.

    Messages of at most 5 bytes, so each is one MPI message even with JACKLRING_MPI_MAX_COUNT=7.
    """
    rank = group.rank()
    if rank == 0:
        adapter.send(np.arange(4, dtype=np.uint8), 1)
        adapter.send(np.arange(5, dtype=np.int8), 1)
        adapter.send(np.arange(4, dtype=np.int8), 1)
    elif rank == 1:
        for _ in range(2):
            try:
                adapter.recv((4,), np.int8, 0)
                failures.append("mismatched recv did not raise")
            except adapter.MismatchError as exc:
                text = str(exc)
                if "rank 1" not in text or "rank 0" not in text:
                    failures.append(f"MismatchError does not name both ranks: {text}")
        check("recv after mismatches", adapter.recv((4,), np.int8, 0), np.arange(4, dtype=np.int8))
    adapter.barrier()


def check_split(group) -> None:
    rank, size = group.rank(), group.size()
    # Even and odd ranks, ordered by descending rank (key).
    sub = group.split(rank % 2, key=size - rank)
    members = [r for r in range(size) if r % 2 == rank % 2]
    members.sort(key=lambda r: size - r)
    assert sub.backend_name == "mpi"
    check("split size", np.asarray(sub.size()), np.asarray(len(members)))
    check("split rank", np.asarray(sub.rank()), np.asarray(members.index(rank)))
    x = np.full(3, rank, np.int64)
    check("split all_sum", adapter.all_sum(x, group=sub), np.full(3, sum(members), np.int64))
    gathered = adapter.all_gather(np.arange(2, dtype=np.int64) + 10 * rank, group=sub)
    check("split all_gather", gathered, np.concatenate([np.arange(2, dtype=np.int64) + 10 * m for m in members]))
    bf = np.full(5, rank + 1, BF16)
    check("split bfloat16 all_sum", adapter.all_sum(bf, group=sub), np.full(5, sum(m + 1 for m in members), BF16))
    # Negative colors are legal in the API (MPI's are not): -1 and 1 must stay distinct groups.
    signed = group.split(-1 if rank == 0 else 1)
    check("split negative color size", np.asarray(signed.size()), np.asarray(1 if rank == 0 else size - 1))
    # The world group still works after splitting, and sub-groups close cleanly.
    check("world after split", adapter.all_sum(np.ones(2, np.int32)), np.full(2, size, np.int32))
    sub.backend.close()
    sub.backend.close()
    try:
        sub.backend.barrier()
        failures.append("barrier on a closed communicator did not raise")
    except adapter.DistributedError as exc:
        if "closed" not in str(exc):
            failures.append(f"closed-communicator error is unclear: {exc}")
    signed.backend.close()


if __name__ == "__main__":
    sys.exit(main())
