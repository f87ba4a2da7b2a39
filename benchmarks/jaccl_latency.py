"""All-sum latency of JACCL over the TCP mesh versus the ring backend, N local ranks.

    .venv/bin/python benchmarks/jaccl_latency.py [--ranks 4] [--rounds 15] [--iters 40]
    .venv/bin/python benchmarks/jaccl_latency.py --profile [--profile-ops 3000] [--profile-bytes 4]

Spawns the ranks itself on 127.0.0.1. Each rank opens both backends; every round times each
(size, backend) pair in turn (interleaved, so load from other processes hits both alike) and the
table shows medians over rounds of the per-call time seen by rank 0, then the CPU time per call
(process time of rank 0 over all its timed calls): with more ranks than cores, CPU decides.

--profile runs back-to-back all_reduce calls of one size on each backend in turn (straight on
the backend object) and prints wall and CPU time per call on every rank and rank 0's cProfile
of the JACCL calls, the hot spots to cut.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from adapter.bench import free_ports

REPO = Path(__file__).resolve().parents[1]
SIZES = [4, 64, 1024, 4096, 65536, 1 << 20]


def open_backends(timeout: float) -> dict:
    from adapter.backends.jaccl import backend as jaccl
    backends = {"jaccl-tcp": jaccl.create(timeout)}
    try:
        from adapter.backends.ring import backend as ring
    except ImportError:
        return backends
    backends["ring"] = ring.create(timeout)
    return backends


def rank_main(args) -> None:
    import numpy as np

    from adapter.backends.base import ReduceOp

    backends = open_backends(60.0)
    if args.profile:
        profile(args, backends)
        return
    times: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], float] = {}
    calls: dict[tuple[str, int], int] = {}
    for _ in range(args.rounds):
        for nbytes in SIZES:
            src = np.ones(max(1, nbytes // 4), np.float32)
            dst = np.empty_like(src)
            iters = args.iters if nbytes <= 65536 else max(3, args.iters // 8)
            for name, b in backends.items():
                b.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                for _ in range(iters):
                    b.all_reduce(src, dst, ReduceOp.SUM)
                key = (name, nbytes)
                times.setdefault(key, []).append((time.perf_counter() - start) / iters)
                cpu[key] = cpu.get(key, 0.0) + time.process_time() - cpu_start
                calls[key] = calls.get(key, 0) + iters
                if dst[0] != b.size():
                    raise SystemExit(f"{name}: wrong all_sum result {dst[0]} (want {b.size()})")
    if backends["jaccl-tcp"].rank() == 0:
        names = list(backends)
        print(f"float32 all_sum, {args.ranks} local ranks, median of {args.rounds} interleaved rounds (rank 0); "
              f"wall time per call, then CPU time per call")
        print("| bytes | " + " | ".join(names) + " | " + " | ".join(f"{n} CPU" for n in names) + " |")
        print("|---|" + "---|" * (2 * len(names)))
        for nbytes in SIZES:
            cells = []
            for name in names:
                cells.append(_fmt(statistics.median(times[(name, nbytes)]), nbytes))
            for name in names:
                cells.append(_fmt(cpu[(name, nbytes)] / calls[(name, nbytes)], nbytes))
            print(f"| {nbytes} | " + " | ".join(cells) + " |")
        sys.stdout.flush()
    for b in backends.values():
        b.barrier()
        b.close()


def _fmt(seconds: float, nbytes: int) -> str:
    return f"{seconds * 1e6:.1f} us" if nbytes <= 65536 else f"{seconds * 1e3:.2f} ms"


def profile(args, backends: dict) -> None:
    import cProfile
    import pstats

    import numpy as np

    from adapter.backends.base import ReduceOp

    src = np.ones(max(1, args.profile_bytes // 4), np.float32)
    dst = np.empty_like(src)
    rank = backends["jaccl-tcp"].rank()
    for name, b in backends.items():
        for _ in range(200):   # warm-up: plans, buffers
            b.all_reduce(src, dst, ReduceOp.SUM)
        b.barrier()
        prof = cProfile.Profile() if rank == 0 and name == "jaccl-tcp" else None
        start, cpu_start = time.perf_counter(), time.process_time()
        if prof:
            prof.enable()
        for _ in range(args.profile_ops):
            b.all_reduce(src, dst, ReduceOp.SUM)
        if prof:
            prof.disable()
        wall, used = time.perf_counter() - start, time.process_time() - cpu_start
        b.barrier()
        print(f"rank {rank} {name}: {wall / args.profile_ops * 1e6:.1f} us/call wall, "
              f"{used / args.profile_ops * 1e6:.1f} us/call CPU{' (profiled)' if prof else ''}", flush=True)
        if prof:
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(20)
            sys.stdout.flush()
    for b in backends.values():
        b.barrier()
        b.close()


def launch(args) -> int:
    n = args.ranks
    with tempfile.TemporaryDirectory() as tmp:
        devices = Path(tmp) / "devices.json"
        devices.write_text(json.dumps([[None if i == j else f"rdma_en{j}" for j in range(n)] for i in range(n)]))
        ports = free_ports(n + 1)
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports[1:]]))
        procs = []
        for rank in range(n):
            env = dict(os.environ, MLX_RANK=str(rank), MLX_JACCL_COORDINATOR=f"127.0.0.1:{ports[0]}",
                       MLX_IBV_DEVICES=str(devices), MLX_HOSTFILE=str(hostfile), PYTHONPATH=str(REPO),
                       JACKLRING_JACCL_TRANSPORT="tcp")
            extra = ["--profile", "--profile-ops", str(args.profile_ops),
                     "--profile-bytes", str(args.profile_bytes)] if args.profile else []
            procs.append(subprocess.Popen([sys.executable, __file__, "--rank-process", "--ranks", str(n),
                                           "--rounds", str(args.rounds), "--iters", str(args.iters)] + extra,
                                          env=env))
        try:
            codes = [p.wait(timeout=args.timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        return max(codes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--profile", action="store_true", help="cProfile rank 0's JACCL all_reduce calls")
    parser.add_argument("--profile-ops", type=int, default=3000)
    parser.add_argument("--profile-bytes", type=int, default=4)
    parser.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_process:
        rank_main(args)
    else:
        sys.exit(launch(args))


if __name__ == "__main__":
    main()
