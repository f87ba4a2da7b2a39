"""One rank of the CUDA DDP step: argv RANK WORLD PORT. Both ranks put the model on cuda:0,
wrap it in DistributedDataParallel over the "jacklring" process group, take one step, and
check the gradients and weights against a single-process computation of the same step."""
import datetime
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import adapter.torch_backend

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
adapter.torch_backend.register_backend()
dist.init_process_group("jacklring", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))
device = torch.device("cuda:0")


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)


gen = torch.Generator().manual_seed(42)
data = torch.randn(world * 8, 16, generator=gen).to(device)
target = torch.randn(world * 8, 4, generator=gen).to(device)

model = DistributedDataParallel(make_model(), device_ids=[0])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mine = slice(rank * 8, (rank + 1) * 8)
loss = torch.nn.functional.mse_loss(model(data[mine]), target[mine])
loss.backward()
opt.step()

# The same step in one process: DDP averages gradients, which for equal shards equals the
# gradient of the mean of the per-shard losses.
ref = make_model()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
ref_loss = sum(torch.nn.functional.mse_loss(ref(data[r * 8:(r + 1) * 8]), target[r * 8:(r + 1) * 8])
               for r in range(world)) / world
ref_loss.backward()
ref_opt.step()
for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
    assert p.device.type == "cuda", name
    assert torch.allclose(p.grad, q.grad, atol=1e-5), (name, (p.grad - q.grad).abs().max().item())
    assert torch.allclose(p, q, atol=1e-5), name
pg = dist.distributed_c10d._get_default_group()
print(f"rank {rank}: CUDA DDP step on jacklring OK ({pg})")
dist.destroy_process_group()
