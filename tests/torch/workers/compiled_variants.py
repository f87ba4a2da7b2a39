"""Two more ways of compiling a distributed model (argv extra: the process group backend, then
the compile backend, "eager" by default): `ddp.compile()` (nn.Module.compile on a DDP-wrapped
model) and FSDP2 (`fully_shard` on a 1-D CPU mesh) then `torch.compile`. Prints each step's
loss ("LOSS ddp.compile 0 ..."), the number of graphs each compiled ("GRAPHS ..."), the mesh's
backend, then "VARIANTS OK". "aot_eager" traces forward and backward as inductor does, without
inductor's C++ build (minutes on a small machine). run() is also the first part of compiled.py."""
from __future__ import annotations

import sys

import torch
import torch._dynamo
import torch.distributed as dist
from common import init
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 3


class Net(torch.nn.Module):
    """Defined here, not in torch: Dynamo skips frames of torch's own modules (nn.Sequential)
    that a compiled DDP wrapper calls, and would compile nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def model() -> Net:
    torch.manual_seed(0)
    return Net()


def train(name: str, net: torch.nn.Module, rank: int) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        print(f"LOSS {name} {step} {total.item():.7f}", flush=True)


GRAPHS: list[int] = []


def counting(compiler: str):
    """The named compile backend, counting the graphs Dynamo hands it (0 would mean nothing was compiled)."""
    inner = torch._dynamo.lookup_backend(compiler)

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        GRAPHS.append(len(gm.graph.nodes))
        return inner(gm, example_inputs)
    return backend


def graphs() -> int:
    return len(GRAPHS)


def run(rank: int, world: int, compiler: str) -> None:
    ddp = DDP(model())
    ddp.compile(backend=counting(compiler))
    train("ddp.compile", ddp, rank)
    print(f"GRAPHS ddp.compile {graphs()}", flush=True)

    mesh = init_device_mesh("cpu", (world,))
    sharded = model()
    for layer in (sharded.hidden, sharded.out):
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    before = graphs()
    train("fsdp2+compile", torch.compile(sharded, backend=counting(compiler)), rank)
    print(f"GRAPHS fsdp2+compile {graphs() - before}", flush=True)
    print(f"MESH BACKEND {dist.get_backend(mesh.get_group())}", flush=True)
    print("VARIANTS OK", flush=True)


def main() -> None:
    backend = next((a for a in sys.argv[1:] if a in ("jacklring", "gloo")), "jacklring")
    compiler = next((a for a in sys.argv[1:] if a in ("eager", "aot_eager", "inductor")), "eager")
    rank, world = init(backend=backend)
    run(rank, world, compiler)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
