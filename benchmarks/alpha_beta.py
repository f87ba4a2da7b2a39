"""The alpha-beta model of every all_reduce schedule jacklring runs between hosts: a step costs
alpha (latency) plus beta per byte a rank sends in it; a reduction adds gamma per byte reduced.

    python benchmarks/alpha_beta.py                      # the cluster profile (20 us, 10 Gbit/s)
    python benchmarks/alpha_beta.py --fit measured.json  # fit alpha, beta to netns_bench figures

With --fit, the file holds [{"hosts": 8, "bytes": 4, "schedule": "ring", "us": 4665.0}, ...]
(netns_bench's medians); alpha and beta are fitted by least squares to each host count's
figures and each figure is printed beside what the model says (the check). The table for 64,
256 and 1,024 hosts uses the cluster profile (--alpha-us, --gbit): on one shared machine a step
costs a scheduling round that grows with the ranks per core, not a network's latency.

The schedules (adapter/backends/algorithms/schedules.py and the ring's plumbing):

- ring: the ring backend's own choice: the one-pass path (n - 1 hops of the whole message) while
  it sends at most 32 KiB per rank, else reduce-scatter + all-gather (2 (n - 1) hops of m / n);
- rd: recursive doubling, log2 p pair steps of the whole message (+ 2 fold steps when n is not
  a power of two, p the largest power of two below n);
- rh: Rabenseifner, 2 log2 p steps sending m/2, m/4, ... then back (2 (p - 1) / p x m in all),
  + 2 fold steps of the whole message;
- mesh: JACCL's one-step exchange (n - 1 messages of m through one interface, one after
  the other: counted as n - 1 steps).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

ONE_PASS_BYTES = 32 * 1024
HOSTS = (64, 256, 1024)
SIZES = (4, 64 << 10, 1 << 20, 64 << 20)


def _fold(n: int) -> tuple[int, int]:
    p = 1 << (n.bit_length() - 1)
    return p, (0 if p == n else 2)


def terms(schedule: str, n: int, m: float) -> tuple[float, float, float]:
    """(steps, bytes sent per rank on the critical path, bytes reduced) of one all_reduce. The
    mesh's one step counts as n - 1 steps: its messages leave one after the other through the
    rank's one interface, each paying the per-message latency."""
    if schedule == "ring":
        if m * (n - 1) <= ONE_PASS_BYTES:
            return n - 1, (n - 1) * m, (n - 1) * m
        return 2 * (n - 1), 2 * (n - 1) * m / n, (n - 1) * m / n
    p, fold = _fold(n)
    k = int(math.log2(p))
    if schedule == "rd":
        return k + fold, (k + fold) * m, (k + fold / 2) * m
    if schedule == "rh":
        return 2 * k + fold, 2 * (p - 1) / p * m + fold * m, (p - 1) / p * m + fold / 2 * m
    if schedule == "mesh":
        return n - 1, (n - 1) * m, (n - 1) * m
    raise ValueError(f"unknown schedule {schedule!r}")


SCHEDULES = ("ring", "rd", "rh", "mesh")


def model_us(schedule: str, n: int, m: float, alpha_us: float, beta_us: float, gamma_us: float) -> float:
    steps, sent, reduced = terms(schedule, n, m)
    return steps * alpha_us + sent * beta_us + reduced * gamma_us


def fit(points: list[dict], gamma_us: float) -> tuple[float, float]:
    """Least squares for alpha and beta (gamma given): t - gamma x reduced = alpha x steps + beta x sent,
    each point weighted by 1 / t so small and large messages count alike."""
    sxx = sxy = syy = sxt = syt = 0.0
    for pt in points:
        steps, sent, reduced = terms(pt["schedule"], pt["hosts"], pt["bytes"])
        w = 1.0 / pt["us"] ** 2
        t = pt["us"] - reduced * gamma_us
        sxx += w * steps * steps
        sxy += w * steps * sent
        syy += w * sent * sent
        sxt += w * steps * t
        syt += w * sent * t
    det = sxx * syy - sxy * sxy
    if det == 0:
        raise SystemExit("alpha_beta: the figures do not tell latency from bandwidth (give several sizes)")
    return (sxt * syy - syt * sxy) / det, (sxx * syt - sxy * sxt) / det


def size_label(m: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if m >= scale:
            return f"{m // scale} {unit}"
    return f"{m} B"


def table(alpha_us: float, beta_us: float, gamma_us: float) -> list[str]:
    lines = ["| hosts | bytes | " + " | ".join(SCHEDULES) + " | best |", "|---|---|" + "---|" * (len(SCHEDULES) + 1)]
    for n in HOSTS:
        for m in SIZES:
            times = {s: model_us(s, n, m, alpha_us, beta_us, gamma_us) for s in SCHEDULES}
            best = min(times, key=times.__getitem__)
            lines.append(f"| {n} | {size_label(m)} | " + " | ".join(f"{times[s] / 1000:.3g} ms" for s in SCHEDULES)
                         + f" | {best} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--alpha-us", type=float, default=20.0, help="latency per step, us (default 20)")
    ap.add_argument("--gbit", type=float, default=10.0, help="link rate, Gbit/s (default 10)")
    ap.add_argument("--gamma-gbs", type=float, default=4.0, help="reduction rate, GB/s (default 4)")
    ap.add_argument("--fit", help="a JSON file of measured figures: fit alpha and beta to them first")
    opts = ap.parse_args(argv)
    alpha, beta = opts.alpha_us, 8 / (opts.gbit * 1e3)  # us per byte
    gamma = 1 / (opts.gamma_gbs * 1e3)
    if opts.fit:
        with open(opts.fit) as f:
            points = json.load(f)
        # On one shared machine a step's latency grows with the ranks per core, so each host count
        # gets its own fit; the schedules' shape (steps and bytes) is what is checked.
        print("| hosts | bytes | schedule | measured | model | model / measured |")
        print("|---|---|---|---|---|---|")
        fits = []
        for hosts in sorted({pt["hosts"] for pt in points}):
            group = [pt for pt in points if pt["hosts"] == hosts]
            a, b = fit(group, gamma)
            fits.append(f"{hosts} hosts: alpha {a:.0f} us per step, beta {b * 1e3:.2f} ns per byte "
                        f"({8 / b / 1e3:.2f} Gbit/s)")
            for pt in group:
                t = model_us(pt["schedule"], pt["hosts"], pt["bytes"], a, b, gamma)
                print(f"| {pt['hosts']} | {size_label(pt['bytes'])} | {pt['schedule']} | {pt['us'] / 1000:.3g} ms | "
                      f"{t / 1000:.3g} ms | {t / pt['us']:.2f} |")
        print("\n# fitted: " + "; ".join(fits))
        print(f"# at scale, the cluster profile: alpha {alpha:g} us per step, {opts.gbit:g} Gbit/s links, "
              f"reduction {opts.gamma_gbs:g} GB/s")
    else:
        print(f"# alpha {alpha:g} us per step, {opts.gbit:g} Gbit/s links, reduction {opts.gamma_gbs:g} GB/s")
    print("\n".join(table(alpha, beta, gamma)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
