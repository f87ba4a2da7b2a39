"""Data-parallel training: an MLP learns scikit-learn's handwritten digits on every rank.

    launcher -n 4 examples/training/data_parallel.py            # 4 local ranks over the ring
    python examples/training/data_parallel.py                   # one process
    launcher -n 4 examples/training/data_parallel.py --ddp      # torch DDP over "jacklring"
    launcher -n 4 examples/training/data_parallel.py --plot curves.png   # + loss/accuracy curves

Every rank walks the same shuffled order of the training set; each global batch is split
into one contiguous shard per rank, each rank computes the gradient of its shard, and
adapter.average_gradients (or DDP) averages them. Each rank scales its summed loss by
size / (global batch), so the average is exactly the gradient of the global batch's mean
loss, uneven shards included: N ranks reach the parameters one rank reaches (up to float
rounding). The data (1,797 8x8 images) ships inside scikit-learn: nothing is downloaded.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from digits import load_digits  # reads the file scikit-learn ships, without importing sklearn
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import adapter  # noqa: E402
from adapter.gradients import average_gradients  # noqa: E402

TEST_SIZE = 297  # of the 1,797 digits; the rest (1,500) train


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--global-batch", type=int, default=64, help="samples per step, over all ranks together")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, help="rank 0 writes the final parameters to this .npz file")
    parser.add_argument("--plot", type=Path,
                        help="rank 0 draws training loss and test accuracy per epoch to this file (.png, .svg; "
                             "needs matplotlib: pip install 'jacklring[plot]')")
    parser.add_argument("--ddp", action="store_true",
                        help="average with torch DistributedDataParallel over the 'jacklring' process group")
    return parser.parse_args()


def load_data(seed: int) -> tuple[torch.Tensor, ...]:
    """The digits, pixels scaled to [0, 1], split once by a seeded shuffle (same on every rank)."""
    pixels, labels = load_digits()
    x = torch.from_numpy((pixels / 16.0).astype(np.float32))
    y = torch.from_numpy(labels.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return x[train], y[train], x[test], y[test]


def make_model(hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


class Averaging:
    """The default: a plain model, gradients averaged with adapter.average_gradients."""

    def __init__(self, model: nn.Module) -> None:
        self.group = adapter.init()
        self.rank, self.size = self.group.rank(), self.group.size()
        self.model = self.train_model = model
        with torch.no_grad():  # every rank starts from rank 0's parameters
            for p in model.parameters():
                p.copy_(adapter.broadcast(p.detach(), 0, group=self.group))

    def average(self) -> None:
        average_gradients(self.model, group=self.group)

    def total(self, value: float) -> float:
        return float(adapter.all_sum(np.array([value]), group=self.group)[0])


class DataParallel:
    """--ddp: torch's DistributedDataParallel over the jacklring process group."""

    def __init__(self, model: nn.Module) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        import adapter.torch_backend

        adapter.torch_backend.register_backend()
        if "WORLD_SIZE" not in os.environ:  # started without a launcher: a group of one
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("jacklring")
        self.dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.model = model
        self.train_model = DistributedDataParallel(model)  # broadcasts rank 0's parameters

    def average(self) -> None:
        pass  # DDP all-reduces the gradients during backward

    def total(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        self.dist.all_reduce(t)
        return float(t[0])


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # the model is tiny: more threads cost more than they give
    x_train, y_train, x_test, y_test = load_data(args.seed)
    model = make_model(args.hidden, args.seed)
    dp = DataParallel(model) if args.ddp else Averaging(model)
    rank, size = dp.rank, dp.size
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if rank == 0:
        mode = "DDP over jacklring" if args.ddp else "adapter.average_gradients"
        print(f"{size} rank(s), {mode}; {len(y_train)} training digits, global batch {args.global_batch}", flush=True)

    steps = -(-len(y_train) // args.global_batch)
    history: list[tuple[int, float, float]] = []  # (epoch, training loss, test accuracy)
    started = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = torch.from_numpy(np.random.default_rng([args.seed, epoch]).permutation(len(y_train)))
        loss_sum = 0.0
        for step in tqdm(range(steps), desc=f"epoch {epoch}", disable=rank != 0, mininterval=0.5, ncols=80):
            batch = order[step * args.global_batch:(step + 1) * args.global_batch]
            mine = torch.tensor_split(batch, size)[rank]  # contiguous shard; may be empty
            loss = F.cross_entropy(dp.train_model(x_train[mine]), y_train[mine], reduction="sum")
            optimizer.zero_grad()
            # Scaled so that averaging over ranks gives the gradient of the global batch's mean loss.
            (loss * (size / len(batch))).backward()
            dp.average()
            optimizer.step()
            loss_sum += loss.item()
        mean_loss = dp.total(loss_sum) / len(y_train)
        if rank == 0:
            history.append((epoch, mean_loss, accuracy(model, x_test, y_test)))
            print(f"epoch {epoch:3d}  loss {mean_loss:.4f}  test accuracy {history[-1][2]:.2%}", flush=True)
    elapsed = time.perf_counter() - started

    if rank == 0 and history:
        # The line to look at: how long, how fast, how good (samples over all ranks together).
        print(f"done: {args.epochs} epochs in {elapsed:.2f} s, {args.epochs * len(y_train) / elapsed:,.0f} samples/s "
              f"over {size} rank(s), final loss {history[-1][1]:.4f}, final test accuracy {history[-1][2]:.2%}",
              flush=True)
    if rank == 0 and args.plot and history:
        from adapter.bench_plot import plot_training

        epochs, losses, accuracies = (list(column) for column in zip(*history))
        plot_training(args.plot, epochs, losses, accuracies,
                      f"digits MLP, {size} rank(s), global batch {args.global_batch}")
        print(f"wrote the loss and accuracy curves to {args.plot}", flush=True)

    if rank == 0 and args.save:
        np.savez(args.save, **{name: p.detach().numpy() for name, p in model.named_parameters()})
        print(f"saved parameters to {args.save}")
    if args.ddp:
        dp.dist.destroy_process_group()


if __name__ == "__main__":
    main()
