"""Forming and destroying the jacklring default group again and again in one process: file://,
then tcp:// twice on the same port, then env://, each checked with a collective, a subgroup and
a point-to-point message, and destroyed. Prints ALL OK. argv: RANK WORLD_SIZE PORT."""
from __future__ import annotations

import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import adapter.torch_backend

adapter.torch_backend.register_backend()
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
BACKEND = os.environ.get("LIFECYCLE_BACKEND", "jacklring")
TIMEOUT = datetime.timedelta(seconds=60)
store_file = os.path.join(tempfile.gettempdir(), f"jacklring-filestore-{port}")


def exercise(how: str) -> None:
    assert dist.get_backend() == BACKEND and dist.get_rank() == rank and dist.get_world_size() == world
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    assert t[0].item() == world * (world + 1) / 2, (how, t[:3])
    sub = dist.new_group(list(range(world)))
    t = torch.ones(3, dtype=torch.int64)
    dist.all_reduce(t, group=sub)
    assert t.tolist() == [world] * 3, (how, t)
    box = torch.zeros(2)
    if rank == 0:
        dist.send(torch.tensor([1.0, 2.0]), dst=1)
    elif rank == 1:
        dist.recv(box, src=0)
        assert box.tolist() == [1.0, 2.0], (how, box)
    dist.barrier()
    print(f"rank {rank}: {how} ok", flush=True)


dist.init_process_group(BACKEND, init_method=f"file://{store_file}", rank=rank, world_size=world, timeout=TIMEOUT)
exercise("file://")
dist.destroy_process_group()

for attempt in (1, 2):  # the same port twice in a row
    dist.init_process_group(BACKEND, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    exercise(f"tcp:// #{attempt}")
    dist.destroy_process_group()
    assert not dist.is_initialized()

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
dist.init_process_group(BACKEND, timeout=TIMEOUT)
exercise("env://")
dist.destroy_process_group()
if rank == 0 and os.path.exists(store_file):
    os.unlink(store_file)
print(f"rank {rank}: lifecycle ALL OK", flush=True)
