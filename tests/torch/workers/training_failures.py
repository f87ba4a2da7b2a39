"""A peer dies (SIGKILL) or stalls (SIGSTOP) in the middle of training: every survivor must end
with a Python exception naming the peer, never a crash in C++ (DDP's reducer reads the
futures of our Works from C++).

argv extra: EVENT CASE [BACKEND]
  EVENT  kill | stall   what happens to the last rank at step 3 (it prints "VICTIM <time>")
         kill_late       kill, and rank 1 (a survivor when there are 3+ ranks) starts step 3
                         half a second late, so it learns of the death from another survivor
  CASE   ddp | ddp_hook | fsdp2 | zero
The group's deadline is 3 s. Survivors print "RAISED <wall time> <type>: <first line>" and
exit 0; the harness kills a stalled victim at the end.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from common import init
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

EVENT, CASE = sys.argv[4], sys.argv[5]
BACKEND = sys.argv[6] if len(sys.argv) > 6 else "jacklring"
STEPS = 200
rank, world = init(timeout_s=3.0, backend=BACKEND)
victim = world - 1


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))


def setup():
    model = net()
    if CASE == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)
    model = DDP(model, bucket_cap_mb=0.1)  # several buckets per step
    if CASE == "ddp_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    if CASE == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.01)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


model, opt = setup()
for step in range(STEPS):
    if rank == victim and step == 3:
        print(f"VICTIM {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP if EVENT == "stall" else signal.SIGKILL)
    if EVENT == "kill_late" and rank == 1 and step == 3:
        time.sleep(0.5)
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    try:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    except Exception as exc:
        print(f"RAISED {time.time():.3f} {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
        print(f"FULL {exc!r}"[:2000], flush=True)
        from adapter import culprit_of
        print(f"CULPRIT {culprit_of(exc)}", flush=True)  # torch re-raises DDP's errors as text only
        os._exit(0)  # skip destroy: the peer is gone
print("NO ERROR: training finished without noticing the missing peer", flush=True)
sys.exit(1)
