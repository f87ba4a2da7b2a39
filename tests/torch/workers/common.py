"""Shared set-up for the worker scripts: argv is RANK WORLD_SIZE PORT [extra ...]."""
from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

import adapter.torch_backend


def init(timeout_s: float = 60.0, backend: str = "jacklring") -> tuple[int, int]:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    adapter.torch_backend.register_backend()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    torch.manual_seed(1234 + rank)
    return rank, world
