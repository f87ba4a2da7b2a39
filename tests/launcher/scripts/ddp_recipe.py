"""docs/torch.md's "DDP after a rank dies" recipe, as written there (its code block is read from
the document and run as is), around a small model: rank --victim SIGKILLs itself in its
optimizer step --kill-at. Each rank that finishes prints `done <rank> <world> <steps> <same>`,
<same> saying whether the parameters are equal on every survivor."""
import argparse
import os
import signal
import textwrap
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: F401  (the recipe uses it)

import adapter
import adapter.torch_backend  # noqa: F401  (registers "jacklring")

DOC = Path(__file__).resolve().parents[3] / "docs" / "torch.md"


def recipe() -> str:
    """The DDP recipe's code block: the first `while step < steps:` block of the document."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "while step < steps:")
    indent = len(lines[start]) - len(lines[start].lstrip())
    block = [lines[start]]
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        block.append(line)
    return textwrap.dedent("\n".join(block))


p = argparse.ArgumentParser()
p.add_argument("--victim", type=int, default=2)
p.add_argument("--kill-at", type=int, default=4)
args = p.parse_args()

dist.init_process_group("jacklring")
me = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
data = torch.randn(96, 8, generator=torch.Generator().manual_seed(1))
target = data.sum(1, keepdim=True)
loss_fn = nn.MSELoss()


class Dying(torch.optim.SGD):
    """SGD whose step --kill-at SIGKILLs rank --victim (a death between two steps)."""
    taken = 0

    def step(self, closure=None):
        if me == args.victim and self.taken == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.taken += 1
        return super().step(closure)


opt = Dying(model.parameters(), lr=0.05)
ddp = DDP(model)
step, steps = 0, 12
exec(compile(recipe(), str(DOC), "exec"))
flat = torch.cat([q.detach().flatten() for q in model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, flat)
print(f"done {dist.get_rank()} {dist.get_world_size()} {step} {all(torch.equal(g, flat) for g in gathered)}",
      flush=True)
dist.destroy_process_group()
