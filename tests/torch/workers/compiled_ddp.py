"""torch.compile(DDP(model)) on the given backend: prints each step's loss (argv extra: backend,
then "shrink" to leave the last rank out with dist.shrink_group afterwards). run() is also the
second part of compiled.py."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from common import extra, init
from torch.nn.parallel import DistributedDataParallel as DDP


def run(rank: int, world: int, args: list[str]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    ddp = torch.compile(DDP(model), backend="eager")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(4):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        print(f"LOSS {step} {total.item():.7f}", flush=True)
    if "shrink" in args and rank == world - 1:
        print("SHRINK EXCLUDED", flush=True)  # torch's rule: an excluded rank does not call shrink_group
    elif "shrink" in args:
        dist.shrink_group([world - 1])
        total = torch.ones(1)
        dist.all_reduce(total)
        print(f"SHRUNK {dist.get_world_size()} {total.item():g}", flush=True)
    print("COMPILED OK", flush=True)


def finish(backend: str) -> None:
    dist.destroy_process_group()
    if backend == "gloo":
        # The gloo run is only the reference's losses. torch 2.13's teardown after compiled DDP on
        # gloo aborts 1 to 2 exits in 8 ("terminate called without an active exception"), on main
        # as on this branch; jacklring's runs still exit normally, so its teardown stays tested.
        sys.stdout.flush()
        os._exit(0)


def main() -> None:
    backend = next((a for a in sys.argv[1:] if a in ("jacklring", "gloo")), "jacklring")
    rank, world = init(backend=backend)
    run(rank, world, extra())
    finish(backend)


if __name__ == "__main__":
    main()
