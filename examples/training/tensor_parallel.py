"""Tensor-parallel training: the feed-forward blocks of a small classifier are split across ranks.

    launcher -n 2 examples/training/tensor_parallel.py        # 2 ranks share every block
    python examples/training/tensor_parallel.py               # one process: the unsharded model

Each block is a transformer-style gated MLP, x + down(silu(gate(n)) * up(n)) with n the
layer-normalised x. The fused gate+up projection is sharded "all-to-sharded" with
segments=2 (each rank keeps its slice of the gate AND of the up matrix), the down
projection "sharded-to-all"; a block then costs one all_sum forward and one backward.
Every rank sees the same batches, and the losses equal the one-process run's.
The data are scikit-learn's handwritten digits (shipped with it, nothing is downloaded).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from digits import load_digits  # reads the file scikit-learn ships, without importing sklearn
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import adapter  # noqa: E402
from adapter.parallel import shard_linear  # noqa: E402

TEST_SIZE = 297


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--dim", type=int, default=96, help="model width")
    parser.add_argument("--hidden", type=int, default=192, help="feed-forward width (the ranks must divide it)")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, help="rank 0 writes the losses and the full (gathered) parameters here (.npz)")
    return parser.parse_args()


class GatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.gate_up = nn.Linear(dim, 2 * hidden)  # gate and up projections fused in one matrix
        self.down = nn.Linear(hidden, dim)

    def shard(self, group: adapter.Group) -> None:
        self.gate_up = shard_linear(self.gate_up, "all-to-sharded", segments=2, group=group)
        self.down = shard_linear(self.down, "sharded-to-all", group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)  # this rank's slice of each
        return x + self.down(F.silu(gate) * up)


class Classifier(nn.Module):
    def __init__(self, dim: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Linear(64, dim)
        self.blocks = nn.ModuleList(GatedMLP(dim, hidden) for _ in range(blocks))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def gather_shards(shard: torch.Tensor, axis: int, segments: int, group: adapter.Group) -> torch.Tensor:
    """The full tensor from every rank's shard (the inverse of sharding along axis with segments)."""
    n = group.size()
    moved = shard.detach().movedim(axis, 0).contiguous()
    pieces = adapter.all_gather(moved, group=group).chunk(n, 0)  # one per rank, in rank order
    parts = [torch.cat([piece.chunk(segments, 0)[s] for piece in pieces], 0) for s in range(segments)]
    return torch.cat(parts, 0).movedim(0, axis)


def full_parameters(model: Classifier, group: adapter.Group) -> dict[str, np.ndarray]:
    """Every parameter under its unsharded name and shape, for comparing runs of any size."""
    sharding = {"gate_up.weight": (0, 2), "gate_up.bias": (0, 2), "down.weight": (1, 1)}
    out = {}
    for name, p in model.named_parameters():
        rule = next((r for suffix, r in sharding.items() if name.endswith(suffix)), None)
        value = p.detach() if rule is None else gather_shards(p, rule[0], rule[1], group)
        out[name] = value.numpy()
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # the model is tiny: more threads cost more than they give
    group = adapter.init()
    rank, size = group.rank(), group.size()

    pixels, labels = load_digits()
    x = torch.from_numpy((pixels / 16.0).astype(np.float32))
    y = torch.from_numpy(labels.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(args.seed).permutation(len(y)))
    x_test, y_test, x_train, y_train = x[order[:TEST_SIZE]], y[order[:TEST_SIZE]], x[order[TEST_SIZE:]], y[order[TEST_SIZE:]]

    torch.manual_seed(args.seed)  # the same full model on every rank, then each keeps its shards
    model = Classifier(args.dim, args.hidden, args.blocks)
    for block in model.blocks:
        block.shard(group)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if rank == 0:
        print(f"{size} rank(s); {args.blocks} gated MLP blocks of width {args.hidden}, "
              f"{args.hidden // size} per rank", flush=True)

    rng = np.random.default_rng([args.seed, 1])
    losses = []
    for step in range(1, args.steps + 1):
        batch = torch.from_numpy(rng.choice(len(y_train), args.batch, replace=False))
        loss = F.cross_entropy(model(x_train[batch]), y_train[batch])
        optimizer.zero_grad()
        loss.backward()  # sharded weights get their own gradients; replicated ones agree on every rank
        optimizer.step()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.5f}", flush=True)

    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    params = full_parameters(model, group)  # a collective: every rank takes part
    if rank == 0:
        print(f"test accuracy {acc:.2%}")
        if args.save:
            np.savez(args.save, losses=np.array(losses), **params)
            print(f"saved losses and parameters to {args.save}")


if __name__ == "__main__":
    main()
