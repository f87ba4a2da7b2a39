"""Whether this process can start an NCCL group: its variables, a visible CUDA device, cupy.

Apart from the backend module so that a probe loads none of it: init(backend="any") probes
NCCL first in every process, and most of them form a group of another backend.
"""
from __future__ import annotations

import importlib.util
import os

from .device import cuda_visible_reason

ENVIRONMENT = ("MLX_RANK", "MLX_WORLD_SIZE", "NCCL_HOST_IP", "NCCL_PORT")


def probe() -> str | None:
    """None when the NCCL environment and a CUDA device are present, else why not."""
    missing = [name for name in ENVIRONMENT if not os.environ.get(name)]
    if missing:
        names = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
        return f"{names} not set"
    reason = cuda_visible_reason()
    if reason is not None:
        return reason
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (pip install 'jacklring[nccl]')"
    return None
