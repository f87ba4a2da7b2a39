"""A torch script as a newcomer writes it, started by mlx.launch: fill_torch_env() turns the MLX
variables into torch's env:// ones, then init_process_group("jacklring") needs no arguments."""
import torch
import torch.distributed as dist

import adapter.torch_backend

added = adapter.torch_backend.fill_torch_env()
dist.init_process_group("jacklring")
x = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(x)
print(f"RESULT {dist.get_rank()} {dist.get_world_size()} {x.tolist()} {sorted(added)}", flush=True)
print(f"DESC {dist.get_rank()} {dist.group.WORLD.description()}", flush=True)
dist.destroy_process_group()
