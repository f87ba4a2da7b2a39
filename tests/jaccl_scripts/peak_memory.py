"""One JACCL rank for the peak-memory test: all_sum of MIB MiB of float32 (src and dst
allocated and touched first), then reports the growth of its peak resident set (VmHWM) over
the baseline taken before allocating, as a multiple of the message.

usage: peak_memory.py MIB OP   (OP: all_reduce or broadcast; environment: the MLX JACCL contract)
"""
from __future__ import annotations

import sys

import numpy as np

from adapter.backends.base import ReduceOp
from adapter.backends.jaccl import backend as jaccl


def peak_rss() -> int:
    """The process's peak resident set in bytes (VmHWM, from the kernel)."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    mib, op = int(sys.argv[1]), sys.argv[2]
    b = jaccl.create()
    r, n = b.rank(), b.size()
    warm = np.ones(1 << 16, np.float32)   # every code path and buffer of a large op, once
    b.all_reduce(warm, warm, ReduceOp.SUM)
    b.broadcast(warm, 0)
    del warm
    count = (mib << 20) // 4
    baseline = peak_rss()
    src = np.full(count, r + 1.0, np.float32)
    if op == "all_reduce":
        dst = np.zeros(count, np.float32)   # touched: the caller's result buffer counts once
        b.all_reduce(src, dst, ReduceOp.SUM)
        ok = bool(dst[0] == dst[-1] == n * (n + 1) / 2)
    else:
        b.broadcast(src, n - 1)
        ok = bool(src[0] == src[-1] == n)
    grown = peak_rss() - baseline
    print(f"rank {r}: {op} of {mib} MiB: peak grew {grown / (1 << 20):.0f} MiB = {grown / (count * 4):.2f} x "
          f"the message; result {'ok' if ok else 'WRONG'}", flush=True)
    b.close()


if __name__ == "__main__":
    main()
