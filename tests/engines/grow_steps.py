"""Steps the engine tests' grow ranks share (slurm_grow_rank.py, torchrun_grow_rank.py)."""
from __future__ import annotations

import numpy as np

import adapter
from adapter.errors import DistributedError


def shrink_after_a_loss(group: adapter.Group) -> tuple[adapter.Group, str]:
    """Sum until a sum fails (a rank left), then shrink: the smaller group, and the failure's
    type name."""
    try:
        while True:
            adapter.all_sum(np.ones(4, np.float32))
    except DistributedError as exc:
        failed = type(exc).__name__
    return group.shrink(timeout=5), failed
