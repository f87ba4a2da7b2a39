"""Shared set-up for the worker scripts.

Spawned by tests/torch/torch_harness.py: argv is RANK WORLD_SIZE PORT [extra ...] and the group
forms over tcp://127.0.0.1:PORT. Under torchrun or the launcher (RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT in the environment): argv is [extra ...] and the group uses env://."""
from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

import adapter.torch_backend

EXTRA: list[str] = []


def init(timeout_s: float = 60.0, backend: str = "jacklring") -> tuple[int, int]:
    global EXTRA
    adapter.torch_backend.register_backend()
    timeout = datetime.timedelta(seconds=timeout_s)
    if len(sys.argv) >= 4 and sys.argv[1].isdigit():
        rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
        EXTRA = sys.argv[4:]
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timeout)
    else:
        EXTRA = sys.argv[1:]
        dist.init_process_group(backend, timeout=timeout)  # env://
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)
    return rank, world


def extra() -> list[str]:
    return EXTRA
