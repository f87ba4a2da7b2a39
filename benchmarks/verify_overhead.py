"""What JACKLRING_VERIFY=1 (a CRC-32C after every ring message, checked on receipt) costs.

    python benchmarks/verify_overhead.py                   # 2 ranks, 4 B .. 64 MiB float32 all_sum
    python benchmarks/verify_overhead.py --sizes 4,1M --rounds 7
    python benchmarks/verify_overhead.py --mode mac         # the keyed BLAKE2b MAC instead
    python benchmarks/verify_overhead.py --transport tcp    # TCP over loopback (default: unix)

Two ring groups live in the same two processes, one formed with JACKLRING_VERIFY=1 and one
without, and are timed in interleaved rounds (median of rounds, and the lower quartile: on a
shared machine the quieter rounds show the cost of the work itself), so machine noise hits both
columns alike; rank 0's CPU time per operation (median of rounds) is the steadier measure of the
work when other jobs share the cores. The ranks share a host, so the ring would run its collectives over shared memory,
where no checksum applies: --transport forces the sockets (JACKLRING_LOCAL_TRANSPORT). busbw as
nccl-tests: 2(n-1)/n * bytes / time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from adapter.bench import free_ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SIZES = "4,64,1K,16K,256K,1M,4M,16M,64M"


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def iterations(nbytes: int) -> int:
    """Enough repetitions for a measurable batch, few for the large sizes."""
    return max(2, min(200, (32 << 20) // max(nbytes, 1 << 10) // 4))


def worker(rank: int, addresses: dict, sizes: list[int], rounds: int, mode: str = "1") -> None:
    sys.path.insert(0, ROOT)
    from adapter.backends.base import ReduceOp
    from adapter.backends.ring.backend import RingBackend

    groups = {}
    os.environ.setdefault("JACKLRING_SECRET", "00" * 32)  # the MAC's key (same on both ranks)
    for name, flag in (("plain", "0"), ("verify", mode)):
        os.environ["JACKLRING_VERIFY"] = flag  # read when the group is formed
        groups[name] = RingBackend.from_addresses(rank, addresses[name])
    results = {}
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        src = np.ones(count, np.float32)
        dst = np.empty_like(src)
        k = iterations(nbytes)
        times = {"plain": [], "verify": []}
        cpu = {"plain": [], "verify": []}
        for name, g in groups.items():  # warm-up: buffers allocated, connections hot
            g.all_reduce(src, dst, ReduceOp.SUM)
        for _ in range(rounds):
            for name, g in groups.items():
                g.barrier()
                t, c = time.perf_counter(), time.process_time()
                for _ in range(k):
                    g.all_reduce(src, dst, ReduceOp.SUM)
                times[name].append((time.perf_counter() - t) / k)
                cpu[name].append((time.process_time() - c) / k)
        if not np.all(dst == 2):
            raise SystemExit(f"rank {rank}: wrong all_sum result at {nbytes} bytes")
        results[nbytes] = {name: statistics.median(v) for name, v in times.items()}
        results[nbytes].update({f"{name} q1": sorted(v)[len(v) // 4] for name, v in times.items()})
        results[nbytes].update({f"{name} cpu": statistics.median(v) for name, v in cpu.items()})
    for g in groups.values():
        g.close()
    if rank == 0:
        print(json.dumps({str(k): v for k, v in results.items()}), flush=True)


def table(results: dict[int, dict[str, float]], n: int, mode: str = "1") -> str:
    lines = [f"| bytes | plain | JACKLRING_VERIFY={mode} | overhead | overhead (lower quartiles) | "
             "overhead (rank 0's CPU per op) | busbw plain | busbw verify |",
             "|---|---|---|---|---|---|---|---|"]
    for nbytes, t in sorted(results.items()):
        bus = 2 * (n - 1) / n * nbytes
        lines.append(f"| {human(nbytes)} | {fmt_time(t['plain'])} | {fmt_time(t['verify'])} | "
                     f"{100 * (t['verify'] / t['plain'] - 1):+.1f}% | {100 * (t['verify q1'] / t['plain q1'] - 1):+.1f}% | "
                     f"{100 * (t['verify cpu'] / t['plain cpu'] - 1):+.1f}% | "
                     f"{bus / t['plain'] / 1e9:.3f} GB/s | {bus / t['verify'] / 1e9:.3f} GB/s |")
    return "\n".join(lines)


def fmt_time(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mode", default="1", choices=("1", "crc", "mac"), help="JACKLRING_VERIFY of the checked group")
    parser.add_argument("--transport", default="unix", choices=("unix", "tcp"),
                        help="JACKLRING_LOCAL_TRANSPORT of both groups: the sockets the checksums travel on")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--addresses", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.worker is not None:
        worker(args.worker, json.loads(args.addresses), sizes, args.rounds, args.mode)
        return
    n = 2
    ports = iter(free_ports(2 * n))
    addresses = {name: [[f"127.0.0.1:{next(ports)}"] for _ in range(n)] for name in ("plain", "verify")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", JACKLRING_LOCAL_TRANSPORT=args.transport)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(r),
                               "--addresses", json.dumps(addresses), "--sizes", args.sizes,
                               "--rounds", str(args.rounds), "--mode", args.mode], env=env, stdout=subprocess.PIPE, text=True)
             for r in range(n)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=900)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit("verify_overhead: ranks did not finish within 900 s")
    if any(p.returncode for p in procs):
        raise SystemExit(f"verify_overhead: a rank failed (exit codes {[p.returncode for p in procs]})")
    results = {int(k): v for k, v in json.loads(outs[0].strip().splitlines()[-1]).items()}
    print(f"all_sum float32, {n} ranks on 127.0.0.1, ring over {args.transport} sockets, "
          f"median of {args.rounds} interleaved rounds")
    print(table(results, n, args.mode))


if __name__ == "__main__":
    main()
