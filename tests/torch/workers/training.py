"""Training on the jacklring group gives the same parameters as on gloo: DDP (plain,
gradient_as_bucket_view, find_unused_parameters, no_sync, a bfloat16 model, static_graph), the fp16 and PowerSGD comm hooks,
ZeroRedundancyOptimizer and FSDP2 fully_shard on CPU. Prints ALL OK.
argv extra: names of the cases to run (default: all)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from common import extra, init
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

rank, world = init()
JL = dist.group.WORLD
GLOO = dist.new_group(backend="gloo")
STEPS = 4
T0 = time.monotonic()


class Net(nn.Module):
    def __init__(self, with_unused: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 4)
        self.unused = nn.Linear(64, 4) if with_unused else None  # used on odd steps only

    def forward(self, x: torch.Tensor, use_unused: bool = False) -> torch.Tensor:
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return self.c(h) + (self.unused(h) if use_unused else 0)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def model(with_unused: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(with_unused)


def ddp_run(group, bucket_mb: float = 0.01, **options) -> list[torch.Tensor]:
    hook = options.pop("hook", None)
    accumulate = options.pop("no_sync", False)
    dtype = options.pop("dtype", torch.float32)
    net = DDP(model(options.get("find_unused_parameters", False)).to(dtype), process_group=group,
              bucket_cap_mb=bucket_mb, **options)  # small buckets: several per step
    if hook is not None:
        state, fn = hook(group)
        net.register_comm_hook(state, fn)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = (v.to(dtype) for v in batch(step))
        opt.zero_grad()
        if accumulate:
            with net.no_sync():
                nn.functional.mse_loss(net(x[:4]), y[:4]).backward()
            nn.functional.mse_loss(net(x[4:]), y[4:]).backward()
        else:
            unused = options.get("find_unused_parameters") and step % 2 == 1
            nn.functional.mse_loss(net(x, use_unused=bool(unused)), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.module.parameters()]


def fp16_hook(group):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return group, default_hooks.fp16_compress_hook


def powersgd_hook(group):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    return ps.PowerSGDState(process_group=group, matrix_approximation_rank=2, start_powerSGD_iter=2,
                            min_compression_rate=0.5), ps.powerSGD_hook


def zero_run(group) -> list[torch.Tensor]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    net = DDP(model(), process_group=group)
    opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, process_group=group, lr=0.01)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    opt.consolidate_state_dict(to=0)
    return [p.detach().clone() for p in net.module.parameters()]


def fsdp_run(group) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    mesh = DeviceMesh.from_group(group, "cpu")
    net = model()
    for layer in (net.a, net.b, net.c):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return [p.full_tensor().detach().clone() for p in net.parameters()]


class Bag(nn.Module):
    """An nn.Embedding(sparse=True): DDP all-reduces its gradient as a sparse tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


def sparse_run(group) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = DDP(Bag(), process_group=group)
    start = net.module.emb.weight.detach().clone()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        ids, y = torch.randint(0, 50, (6, 5), generator=g), torch.randn(6, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(net(ids), y).backward()
        assert net.module.emb.weight.grad.is_sparse
        opt.step()
    assert not torch.equal(start, net.module.emb.weight), "sparse: the embedding did not train"
    return [p.detach().clone() for p in net.module.parameters()]


CASES = {
    "ddp": lambda g: ddp_run(g),
    "bucket_view": lambda g: ddp_run(g, gradient_as_bucket_view=True),
    "unused": lambda g: ddp_run(g, find_unused_parameters=True),
    "no_sync": lambda g: ddp_run(g, no_sync=True),
    "bf16": lambda g: ddp_run(g, dtype=torch.bfloat16),
    "static_graph": lambda g: ddp_run(g, static_graph=True),
    "fp16_hook": lambda g: ddp_run(g, hook=fp16_hook),
    "powersgd": lambda g: ddp_run(g, bucket_mb=25, hook=powersgd_hook),
    "sparse": sparse_run,
    "zero": zero_run,
    "fsdp2": fsdp_run,
}

chosen = [c for c in extra() if not c.startswith("--")] or list(CASES)
if "--expect-ring-from-hostfile" in extra():  # under our launcher: the MLX_* ring, not a store ring
    import os

    from adapter.torch_backend.cpp_backend import python_group
    from adapter.torch_backend.process_group import JacklringProcessGroup
    behind = python_group(JL, JacklringProcessGroup)  # the Python group itself, or the one behind the C++ Backend
    assert behind.underlying_backend == "ring" and behind.rendezvous == "environment", behind.description()
    assert os.environ.get("MLX_HOSTFILE"), "the launcher did not set MLX_HOSTFILE"
    print(f"rank {rank}: underlying backend: ring (MLX_HOSTFILE)", flush=True)
for name in chosen:
    theirs = CASES[name](GLOO)
    print(f"rank {rank}: {name}: gloo run done at {time.monotonic() - T0:.1f} s", flush=True)
    ours = CASES[name](JL)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), \
            f"rank {rank}: {name}: parameter {i} differs from gloo's by {(a - b).abs().max().item()}"
    exact = all(torch.equal(a, b) for a, b in zip(ours, theirs))
    fresh = [p.detach() for p in model().parameters()]
    moved = name == "sparse" or any(not torch.equal(a, b) for a, b in zip(ours, fresh))  # sparse_run checks itself
    assert moved, f"{name}: training did not change the parameters"
    print(f"rank {rank}: {name}: parameters match gloo ({'bit-exact' if exact else 'within 1e-5'})", flush=True)

dist.destroy_process_group()
print(f"rank {rank}: destroyed at {time.monotonic() - T0:.1f} s", flush=True)
print(f"rank {rank}: training ALL OK")
