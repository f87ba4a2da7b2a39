"""A group formed while the C++ Backend cannot (or must not) be used: the Python group runs it."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from common import init

from adapter.torch_backend.process_group import JacklringProcessGroup

logging.basicConfig(level=logging.WARNING)


def main() -> None:
    init()
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, JacklringProcessGroup), type(pg)
    t = torch.arange(4.0)
    dist.all_reduce(t)
    assert torch.equal(t, torch.arange(4.0) * dist.get_world_size())
    dist.destroy_process_group()
    print("ALL OK")


if __name__ == "__main__":
    main()
