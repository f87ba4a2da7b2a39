"""The Accelerate recipe of docs/launching.md: the jacklring group first, then Accelerator(cpu=True).
Prints RESULT {"rank", "size", "backend", "replicas_equal", "adapter_size"}."""
import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator

import adapter
import adapter.torch_backend  # registers "jacklring"

adapter.torch_backend.fill_torch_env()          # under accelerate launch --mpirun_hostfile: RANK, WORLD_SIZE
dist.init_process_group("jacklring")            # before Accelerator()
accelerator = Accelerator(cpu=True)
torch.manual_seed(accelerator.process_index)    # different replicas: DDP must make them equal
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
rank = accelerator.process_index
loss = model(torch.full((8, 4), float(rank))).pow(2).mean()
accelerator.backward(loss)
optimizer.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.zeros_like(flat) for _ in range(accelerator.num_processes)]
dist.all_gather(gathered, flat)
world = adapter.init()
sys.stdout.write("RESULT " + json.dumps({
    "rank": rank, "size": accelerator.num_processes, "backend": dist.get_backend(),
    "replicas_equal": all(torch.equal(gathered[0], t) for t in gathered),
    "adapter_size": world.size()}) + "\n")  # one write: ranks share the pipe
sys.stdout.flush()
