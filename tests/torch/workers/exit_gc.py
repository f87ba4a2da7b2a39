"""Cyclic garbage left by a script is freed before interpreter finalization once a jacklring
group exists. Prints what its finalizer saw."""
from __future__ import annotations

import gc
import sys

import torch
import torch.distributed as dist
from common import init
from torch import nn

rank, world = init()
dist.all_reduce(torch.ones(4))
dist.destroy_process_group()


class Cycle:
    def __init__(self) -> None:
        self.me = self
        self.model = nn.Linear(4, 4)  # a module with tensors, as training leaves behind

    def __del__(self) -> None:
        print(f"rank {rank}: cycle freed while finalizing: {sys.is_finalizing()}", flush=True)


gc.disable()  # only an explicit collection may free it: the exit hook's, or none
Cycle()
print(f"rank {rank}: exit_gc ALL OK", flush=True)
