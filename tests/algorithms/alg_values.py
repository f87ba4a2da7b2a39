"""Inputs for the determinism checks: float32 values of very different magnitudes and signs, so
that summing them in another order gives other bits (reference_order_matters proves it)."""
from __future__ import annotations

import numpy as np


def contribution(rank: int, count: int) -> np.ndarray:
    i = np.arange(count)
    exponent = (rank * 7 + i * 3) % 9 - 4
    mantissa = 1.0 + ((rank * 2654435761 + i * 40503) % 9973) / 9973.0
    sign = np.where((rank * 3 + i) % 4 < 2, -1.0, 1.0)
    return (sign * mantissa * 4.0 ** exponent).astype(np.float32)


def linear_sum(n: int, count: int) -> np.ndarray:
    """Rank order, left to right: what a schedule that reduces in rank order computes."""
    acc = contribution(0, count)
    for r in range(1, n):
        acc = acc + contribution(r, count)
    return acc


def doubling_sum(n: int, count: int) -> np.ndarray:
    """The reduction tree of recursive doubling with folding (algorithms/schedules.py): the folded
    pairs first (lower + higher), then blocks of 2, 4, ... virtual ranks, lower + higher."""
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    parts = [contribution(2 * v, count) + contribution(2 * v + 1, count) if v < rem
             else contribution(v + rem, count) for v in range(p)]
    while len(parts) > 1:
        parts = [parts[k] + parts[k + 1] for k in range(0, len(parts), 2)]
    return parts[0]
