"""`python -m adapter.bench`'s table: time, algbw and busbw per size and system, the ratios to the
first system, torch's own floor and CPU time where measured; and the sizes as people write
them (parse_size, human)."""
from __future__ import annotations

import argparse
import statistics
import sys

# Beside torch-api: torch's own cost per call, a C++ c10d Backend that does nothing (csrc/torch/floor.h).
FLOOR = "torch-floor"


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def human(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def report(args: argparse.Namespace, results: dict, n: int, link_rate: float | None = None) -> None:
    """Print the table; with link_rate (bytes/s per direction of each rank's link) a column
    "link" gives busbw as a fraction of it (benchmarks/netns_bench.py shapes such links)."""
    factor = 2 * (n - 1) / n
    names = [name for name in args.backends if any(key[1] == name for key in results)]
    pick = min if args.stat == "min" else statistics.median
    print(f"# all_sum float32, {n} ranks, {args.stat} of {args.rounds} interleaved rounds; "
          f"time in us, algbw/busbw in GB/s" + (f", link = busbw / {link_rate / 1e9:.4g} GB/s" if link_rate else ""))
    head = f"{'bytes':>8}"
    for name in names:
        head += f" | {name + ' time':>14} {'algbw':>7} {'busbw':>7}" + (f" {'link':>5}" if link_rate else "") + f" {'ok':>3}"
    print(head)
    for nbytes in args.sizes:
        line = f"{human(nbytes):>8}"
        for name in names:
            res = results[(nbytes, name)]
            t = pick(res["times"])
            alg = nbytes / t / 1e9
            line += f" | {t * 1e6:>14.1f} {alg:>7.3f} {alg * factor:>7.3f}"
            if link_rate:
                line += f" {alg * factor * 1e9 / link_rate:>5.2f}"
            line += f" {'-' if res['ok'] is None else 'yes' if res['ok'] else 'NO':>3}"
        print(line)
    if len(names) > 1:
        base = names[0]
        print(f"\n# time ratio vs {base} (>1 means {base} is faster)")
        print(f"{'bytes':>8} | " + " | ".join(f"{name:>10}" for name in names[1:]))
        for nbytes in args.sizes:
            t0 = pick(results[(nbytes, base)]["times"])
            print(f"{human(nbytes):>8} | " + " | ".join(
                f"{pick(results[(nbytes, name)]['times']) / t0:>10.2f}" for name in names[1:]))
    if FLOOR in names and "torch-api" in names:
        print(f"\n# torch-api / {FLOOR}: how far above torch's own cost per call the jacklring group runs")
        for nbytes in args.sizes:
            floor = pick(results[(nbytes, FLOOR)]["times"])
            print(f"{human(nbytes):>8} | {pick(results[(nbytes, 'torch-api')]['times']) / floor:>10.2f}")
    if all(results[(nbytes, name)].get("cpu") for nbytes in args.sizes for name in names):
        print(f"\n# CPU time per call, rank 0, us ({args.stat} of rounds)")
        print(f"{'bytes':>8} | " + " | ".join(f"{name:>10}" for name in names))
        for nbytes in args.sizes:
            print(f"{human(nbytes):>8} | " + " | ".join(
                f"{pick(results[(nbytes, name)]['cpu']) * 1e6:>10.1f}" for name in names))
    sys.stdout.flush()
