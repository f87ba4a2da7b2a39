"""The Lightning Fabric recipe of docs/launching.md: Fabric starts the processes and the
jacklring group; adapter.init() afterwards uses that group."""
import json
import sys

import lightning as L
import torch
from lightning.fabric.strategies import DDPStrategy

import adapter
import adapter.torch_backend  # noqa: F401  (registers "jacklring")

fabric = L.Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="jacklring"))
fabric.launch()
torch.manual_seed(fabric.global_rank)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
loss = model(torch.full((8, 4), float(fabric.global_rank))).pow(2).mean()
fabric.backward(loss)
optimizer.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = fabric.all_gather(flat)
plain = torch.nn.Linear(2, 1)
for p in plain.parameters():
    p.grad = torch.full_like(p, float(fabric.global_rank))
adapter.average_gradients(plain)
sys.stdout.write("RESULT " + json.dumps({
    "rank": fabric.global_rank, "size": fabric.world_size,
    "backend": torch.distributed.get_backend(),
    "replicas_equal": all(torch.equal(gathered[0], t) for t in gathered),
    "adapter_size": adapter.init().size(), "averaged": float(plain.bias.grad[0])}) + "\n")  # one write: ranks share the pipe
sys.stdout.flush()
