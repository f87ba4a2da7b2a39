"""The placement check: N fresh 2-rank jobs, each timing a 1 MiB in-place all-reduce.

    python benchmarks/placement_jobs.py                 # 20 jobs, 1 MiB, 300 calls each
    python benchmarks/placement_jobs.py --jobs 6 --pause 30 --bytes 65536

Each job is a fresh `launcher -n 2` of this file (a new pair of processes, so the host may place
its CPUs differently from the last job). Rank 0 first runs the placement probe (a cache line's
round trip between CPUs 0 and 1, as `python -m adapter.bench` prints it), then both ranks time
`adapter.all_sum(x, out=x)` call by call; rank 0 reports the median and the fastest call. The
table ends with the slowest and fastest job medians and their ratio (the target: within 1.5x).

The launcher comes from the Python that runs this file, so a baseline checkout's venv measures
the baseline's engine: `/path/to/base/.venv/bin/python benchmarks/placement_jobs.py`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MARK = "placement-job "


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=20, help="fresh 2-rank jobs to start (default 20)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per job (default 2)")
    p.add_argument("--bytes", type=int, default=1 << 20, help="float32 message size in bytes (default 1 MiB)")
    p.add_argument("--calls", type=int, default=300, help="timed calls per job (default 300)")
    p.add_argument("--warmup", type=int, default=30, help="untimed calls first (default 30)")
    p.add_argument("--pause", type=float, default=0.0, help="seconds between jobs (placements change over minutes)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one job may take")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    """One rank of one job (started by the launcher)."""
    import numpy as np

    probe = None
    if os.environ.get("MLX_RANK", os.environ.get("RANK")) == "0":
        # Before the group forms, while the other rank waits in init: nothing else runs on the CPUs.
        from adapter.backends.local import _engine
        probe = _engine.cache_line_round_trip(0, 1, 64, 200)
    import adapter
    group = adapter.init(strict=True)
    x = np.zeros(args.bytes // 4, dtype=np.float32)
    for _ in range(args.warmup):
        adapter.all_sum(x, out=x, group=group)
    times = []
    clock = time.perf_counter_ns
    for _ in range(args.calls):
        t0 = clock()
        adapter.all_sum(x, out=x, group=group)
        times.append(clock() - t0)
    if group.rank() == 0:
        print(MARK + json.dumps({"probe_ns": probe, "median_us": statistics.median(times) / 1e3,
                                 "min_us": min(times) / 1e3, "backend": group.backend_name,
                                 "engine": _engine_file()}), flush=True)


def _engine_file() -> str:
    try:
        from adapter.backends.local import _engine
    except ImportError:
        return "none"
    return str(_engine.__file__)


def one_job(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "launcher.cli", "-n", str(args.ranks), sys.executable, os.path.abspath(__file__), "--worker",
           "--bytes", str(args.bytes), "--calls", str(args.calls), "--warmup", str(args.warmup)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if MARK in line:
            return json.loads(line.split(MARK, 1)[1])
    raise RuntimeError(f"job exited {proc.returncode} without a result:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    print(f"# {args.jobs} fresh jobs of `launcher -n {args.ranks}`, {args.bytes} B float32 `adapter.all_sum(x, out=x)`, "
          f"median of {args.calls} calls each; load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    print("| job | probe (ns) | median (µs) | fastest call (µs) | load |")
    print("|---|---|---|---|---|")
    medians, fastest_calls = [], []
    for job in range(args.jobs):
        if job and args.pause:
            time.sleep(args.pause)
        result = one_job(args)
        medians.append(result["median_us"])
        fastest_calls.append(result["min_us"])
        probe = f"{result['probe_ns']:.0f}" if result["probe_ns"] is not None else "-"
        print(f"| {job + 1} | {probe} | {result['median_us']:.1f} | {result['min_us']:.1f} | "
              f"{os.getloadavg()[0]:.2f} |", flush=True)
    slowest, fastest = max(medians), min(medians)
    print(f"\nslowest job median {slowest:.1f} µs, fastest {fastest:.1f} µs: {slowest / fastest:.2f}x "
          f"(target: within 1.5x)")
    # On a loaded host a job's median is mostly the scheduler's; its fastest call is not.
    print(f"by fastest call: slowest job {max(fastest_calls):.1f} µs, fastest {min(fastest_calls):.1f} µs: "
          f"{max(fastest_calls) / min(fastest_calls):.2f}x; load average {os.getloadavg()[0]:.2f} at the end")
    print(f"backend {result['backend']}, engine {result['engine']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
