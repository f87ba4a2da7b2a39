"""Soak: thousands of mixed collectives of random sizes, every result checked, no fd or thread leaked.

    python benchmarks/soak.py --spawn 4 --backend ring --ops 10000      # starts 4 local ranks itself
    python benchmarks/soak.py --spawn 3 --backend jaccl --ops 3000      # JACCL over the TCP mesh
    launcher -n 4 benchmarks/soak.py --ops 10000                        # or under the launcher

Every rank draws the same sequence of operations from one seeded generator: all_sum / all_max /
all_min, all_gather, sum_scatter, broadcast from a random root, barrier, and send/recv between a
random pair. Sizes are mostly small, some medium, a few up to ~1 MB. Inputs are small integers
(exact in every dtype used, bfloat16 included), a function of (rank, op index), so each rank
computes every result locally and compares bit for bit.

Leaks: /proc/self/fd and threading.active_count() are counted after a warm-up that opens every
lazily created connection (one send/recv between each ordered pair of ranks), and again after
the soak; a split group is formed, used, closed with backend.close(), and must give back its fds.
Each rank prints one line `SOAK {json}`: ops, seconds, fds and threads (after the warm-up, after
the soak) and split_fds (before the split, while it is open, after backend.close()).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from adapter.bench import free_ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("sum", "max", "min", "all_gather", "sum_scatter", "broadcast", "barrier", "sendrecv")
WEIGHTS = (0.25, 0.1, 0.1, 0.15, 0.1, 0.12, 0.08, 0.1)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def settled_threads(within: float = 5.0) -> int:
    """The number of threads once the ring's standby openers have ended: the first exchange
    with a peer opens a standby connection on a short-lived thread, which a loaded host may
    still be running when the warm-up ends (it is no leak: it ends by itself)."""
    end = time.monotonic() + within
    while time.monotonic() < end and any(t.name.startswith("jacklring-standby-") for t in threading.enumerate()):
        time.sleep(0.01)
    return threading.active_count()


def draw_size(rng: np.random.Generator) -> int:
    roll = rng.random()
    if roll < 0.88:
        return int(rng.integers(1, 257))
    if roll < 0.985:
        return int(rng.integers(257, 16_385))
    return int(rng.integers(16_385, 262_145))  # up to 1 MiB of float32


def inputs(index: int, rank: int, size: int, dtype) -> np.ndarray:
    """Rank `rank`'s input for op `index`: integers 0..12, exact in every dtype used."""
    base = (np.arange(size, dtype=np.int64) * (index % 31 + 1) + 7 * rank + index) % 13
    return base.astype(dtype)


def soak(group, ops: int, seed: int) -> dict:
    import ml_dtypes

    import adapter

    r, n = group.rank(), group.size()
    dtypes = [np.float32, np.int32, np.float64, np.int64, ml_dtypes.bfloat16]
    # warm-up: every point-to-point connection is opened before the fds are counted
    for a in range(n):
        for b in range(n):
            if a != b and r == a:
                adapter.send(np.zeros(1, np.int8), b, group=group)
            elif a != b and r == b:
                adapter.recv((1,), np.int8, a, group=group)
    adapter.barrier(group=group)
    threads0 = settled_threads()  # first: an opener still running has no socket yet
    # and the peers' openers too: the socket a peer's standby opener makes to this rank is
    # accepted here, so it is counted only once every rank's openers have ended
    adapter.barrier(group=group)
    fds0 = open_fds()
    rng = np.random.default_rng(seed)
    started = time.monotonic()
    for i in range(ops):
        kind = KINDS[rng.choice(len(KINDS), p=WEIGHTS)]
        size = draw_size(rng)
        dtype = dtypes[int(rng.integers(len(dtypes)))]
        root = int(rng.integers(n))
        pair = rng.choice(n, 2, replace=False)
        if kind == "barrier":
            adapter.barrier(group=group)
            continue
        if kind == "sum_scatter":
            size = max(1, size // n) * n
        mine = inputs(i, r, size, dtype)
        if kind == "sendrecv":
            src, dst = int(pair[0]), int(pair[1])
            if r == src:
                adapter.send(mine, dst, group=group)
            elif r == dst:
                check(i, kind, adapter.recv((size,), dtype, src, group=group), inputs(i, src, size, dtype))
            continue
        everyone = [inputs(i, q, size, dtype) for q in range(n)]
        if kind == "sum":
            want = np.sum([e.astype(np.int64) for e in everyone], axis=0).astype(dtype)
            check(i, kind, adapter.all_sum(mine, group=group), want)
        elif kind == "max":
            check(i, kind, adapter.all_max(mine, group=group), np.max(everyone, axis=0))
        elif kind == "min":
            check(i, kind, adapter.all_min(mine, group=group), np.min(everyone, axis=0))
        elif kind == "all_gather":
            check(i, kind, adapter.all_gather(mine, group=group), np.concatenate(everyone))
        elif kind == "sum_scatter":
            total = np.sum([e.astype(np.int64) for e in everyone], axis=0).astype(dtype)
            block = size // n
            check(i, kind, adapter.sum_scatter(mine, group=group), total[r * block:(r + 1) * block])
        elif kind == "broadcast":
            check(i, kind, adapter.broadcast(mine, root=root, group=group), everyone[root])
    adapter.barrier(group=group)
    seconds = time.monotonic() - started
    threads1 = settled_threads()
    fds1 = open_fds()
    # a split group gives back everything it opened when closed
    before_split = open_fds()
    sub = group.split(r % 2)
    got = adapter.all_sum(np.ones(1000, np.float32), group=sub)
    check(-1, "split all_sum", got, np.full(1000, len(range(r % 2, n, 2)), np.float32))
    during_split = open_fds()
    sub.backend.close()
    after_split = open_fds()
    return {"rank": r, "ops": ops, "seconds": round(seconds, 2), "fds": (fds0, fds1),
            "threads": (threads0, threads1), "split_fds": (before_split, during_split, after_split), "split_size": sub.size()}


def check(index: int, kind: str, got: np.ndarray, want: np.ndarray) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
        raise SystemExit(f"SOAK-WRONG op {index} ({kind}, {want.dtype}, {want.size} elements): "
                         f"got {got.ravel()[:6]} want {want.ravel()[:6]}")


# ---- driver: start ranks locally -----------------------------------------------------------------

def rank_environments(backend: str, n: int, directory: str) -> list[dict[str, str]]:
    if backend == "ring":
        path = os.path.join(directory, "hosts.json")
        with open(path, "w") as f:
            json.dump([[f"127.0.0.1:{p}"] for p in free_ports(n)], f)
        return [{"MLX_RANK": str(r), "MLX_HOSTFILE": path} for r in range(n)]
    path = os.path.join(directory, "devices.json")
    with open(path, "w") as f:
        json.dump([[None if i == j else f"rdma_en{j}" for j in range(n)] for i in range(n)], f)
    coordinator = f"127.0.0.1:{free_ports(1)[0]}"
    return [{"MLX_RANK": str(r), "MLX_IBV_DEVICES": path, "MLX_JACCL_COORDINATOR": coordinator,
             "JACKLRING_JACCL_TRANSPORT": "tcp"} for r in range(n)]


def spawn(n: int, backend: str, ops: int, seed: int, timeout: float) -> list[dict]:
    """Run n ranks of this script; returns each rank's result (raises with their output on failure)."""
    with tempfile.TemporaryDirectory(prefix="soak-") as directory:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "JACKLRING_JACCL"))}
        base.update(PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        base.setdefault("JACKLRING_TIMEOUT", "60")
        base.setdefault("JACKLRING_CONNECT_TIMEOUT", "60")
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--backend", backend,
                                   "--ops", str(ops), "--seed", str(seed)], env=dict(base, **env),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for env in rank_environments(backend, n, directory)]
        deadline = time.monotonic() + timeout
        outputs = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                outputs.append((p.returncode, out, err))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise SystemExit(f"soak: ranks still running after {timeout} s")
    bad = [(r, o) for r, o in enumerate(outputs) if o[0] != 0]
    if bad:
        raise SystemExit("\n".join(f"--- rank {r} exit {o[0]}\n{o[1][-2000:]}\n{o[2][-4000:]}" for r, o in bad))
    return [json.loads(out.strip().splitlines()[-1].split(" ", 1)[1]) for _, out, _ in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=20240607)
    parser.add_argument("--backend", default="any", help="ring, jaccl, ... (default: any from the environment)")
    parser.add_argument("--spawn", type=int, default=0, metavar="N", help="start N local ranks and report")
    parser.add_argument("--timeout", type=float, default=1800.0, help="with --spawn: give up after this long")
    args = parser.parse_args()
    if args.spawn:
        t = time.monotonic()
        results = spawn(args.spawn, args.backend if args.backend != "any" else "ring", args.ops, args.seed,
                        args.timeout)
        for res in results:
            print("SOAK", json.dumps(res))
        print(f"soak: {args.ops} ops on {args.spawn} ranks ({args.backend}) in {time.monotonic() - t:.1f} s, "
              f"every result checked")
        return
    import adapter

    group = adapter.init(strict=True, backend=args.backend)
    print("SOAK", json.dumps(soak(group, args.ops, args.seed)), flush=True)


if __name__ == "__main__":
    main()
