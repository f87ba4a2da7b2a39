"""Tensor-parallel MLP forward latency per layer: DTensor on jacklring vs gloo, and adapter.parallel.

    launcher -n 2 benchmarks/tp_latency.py
    launcher -n 2 benchmarks/tp_latency.py --dim 1024 --tokens 8 --layers 8 --rounds 5

A stack of `--layers` MLP blocks (Linear(dim, 4 dim), ReLU, Linear(4 dim, dim)), each split over
the ranks as Megatron does: the up projection by output features, the down projection by input
features, so each block costs one all-reduce of its output (tokens x dim floats) in forward.
Variants, timed in interleaved rounds in the same processes (forward only, under no_grad):

- `dtensor-jacklring`, `dtensor-gloo`: torch.distributed.tensor.parallel's ColwiseParallel /
  RowwiseParallel on a 1-D DeviceMesh over the jacklring default group / a gloo group;
- `adapter.parallel`: AllToShardedLinear / ShardedToAllLinear over adapter.init()'s group;
- `local shards`: the same per-rank matrix products with no communication (the compute floor).

Rank 0 prints the median forward time per layer (us) and its difference from the compute floor.
Run it under the launcher (or torchrun): it needs RANK / WORLD_SIZE / MASTER_ADDR.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=8, help="rows of the input (batch x sequence)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20, help="forward passes per round")
    return p.parse_args()


def main() -> None:
    args = parse()
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import adapter
    import adapter.parallel as tp
    import adapter.torch_backend  # noqa: F401  registers "jacklring"

    torch.set_num_threads(1)
    dist.init_process_group("jacklring")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    group = adapter.init()

    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.ReLU(), nn.Linear(4 * args.dim, args.dim))

    def dtensor_stack(pg) -> nn.Module:
        mesh = DeviceMesh.from_group(pg, "cpu")
        torch.manual_seed(0)
        stack = nn.Sequential(*[block() for _ in range(args.layers)])
        for b in stack:
            parallelize_module(b, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return stack

    def adapter_stack() -> nn.Module:
        torch.manual_seed(0)
        stack = nn.Sequential(*[block() for _ in range(args.layers)])
        for b in stack:
            b[0] = tp.shard_linear(b[0], "all-to-sharded", group=group)
            b[2] = tp.shard_linear(b[2], "sharded-to-all", group=group)
        return stack

    def local_stack() -> nn.Module:
        """Each rank's shards as plain Linear layers: the matrix products, no all-reduce."""
        shard = 4 * args.dim // world
        return nn.Sequential(*[nn.Sequential(nn.Linear(args.dim, shard), nn.ReLU(), nn.Linear(shard, args.dim))
                               for _ in range(args.layers)])

    variants = {"dtensor-jacklring": dtensor_stack(dist.group.WORLD), "dtensor-gloo": dtensor_stack(gloo),
                "adapter.parallel": adapter_stack(), "local shards": local_stack()}
    torch.manual_seed(1)
    x = torch.randn(args.tokens, args.dim)
    outputs = {}
    with torch.no_grad():
        for name, model in variants.items():  # warm-up, and the results to compare
            for _ in range(3):
                out = model(x)
            outputs[name] = out.full_tensor() if hasattr(out, "full_tensor") else out
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.rounds):
            names = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in names:
                dist.barrier(group=gloo)
                start = time.perf_counter()
                for _ in range(args.iters):
                    variants[name](x)
                times[name].append((time.perf_counter() - start) / args.iters / args.layers)
    agree = (torch.allclose(outputs["dtensor-jacklring"], outputs["dtensor-gloo"], atol=1e-5)
             and torch.allclose(outputs["dtensor-jacklring"], outputs["adapter.parallel"], atol=1e-4))
    if rank == 0:
        us = {name: statistics.median(v) * 1e6 for name, v in times.items()}
        floor = us["local shards"]
        print(f"tensor-parallel MLP forward, {world} ranks, dim {args.dim}, {args.tokens} tokens, "
              f"{args.layers} layers, median of {args.rounds} rounds x {args.iters} passes; "
              f"load average {os.getloadavg()[0]:.1f}")
        print(f"{'variant':<20} {'us / layer':>11} {'over compute':>13}")
        for name, t in us.items():
            print(f"{name:<20} {t:>11.1f} {t - floor:>13.1f}")
        print(f"outputs agree (DTensor jacklring = gloo = adapter.parallel): {agree}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
