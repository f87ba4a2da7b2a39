"""DDP training-step time with the jacklring backend vs gloo, in the same run.

    python benchmarks/ddp_step.py                  # spawns 2 local ranks
    torchrun --nproc-per-node 2 benchmarks/ddp_step.py

A ~25M-parameter MLP (1024 -> 4096 -> 4096 -> 1024, float32), one DDP model per backend on
the same ranks; rounds alternate between the backends so both see the same machine load.
Rank 0 prints the median step time (forward + backward with overlapped gradient all-reduce +
SGD step) and the median all-reduce time of the whole gradient (100 MB) alone.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6, help="measured rounds (each: steps per backend)")
    p.add_argument("--steps", type=int, default=2, help="steps per backend per round")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / ranks)")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--worker", nargs=3, metavar=("RANK", "WORLD", "PORT"), help=argparse.SUPPRESS)
    return p.parse_args()


def spawn(args: argparse.Namespace) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [a for a in sys.argv[1:]]
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--worker", str(r), str(args.ranks), str(port)],
                              env=env) for r in range(args.ranks)]
    try:
        codes = [p.wait(timeout=args.timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        print(f"benchmark did not finish within {args.timeout:g} s", file=sys.stderr)
        return 1
    return max(abs(c) for c in codes)


def run(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import adapter.torch_backend

    adapter.torch_backend.register_backend()
    timeout = datetime.timedelta(seconds=args.timeout)
    if args.worker:
        rank, world, port = map(int, args.worker)
        dist.init_process_group("jacklring", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timeout)
    else:
        dist.init_process_group("jacklring", timeout=timeout)
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // world))
    groups = {"jacklring": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                             nn.Linear(4096, 1024))

    models = {name: DDP(make(), process_group=g) for name, g in groups.items()}
    params = sum(p.numel() for p in models["gloo"].parameters())
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-4) for name, m in models.items()}
    x = torch.randn(args.batch, 1024)
    y = torch.randn(args.batch, 1024)
    grad = torch.ones(params)
    step_times: dict[str, list[float]] = {name: [] for name in groups}
    reduce_times: dict[str, list[float]] = {name: [] for name in groups}

    def step(name: str) -> float:
        dist.barrier(group=groups["gloo"])
        start = time.perf_counter()
        opts[name].zero_grad()
        nn.functional.mse_loss(models[name](x), y).backward()
        opts[name].step()
        return time.perf_counter() - start

    def reduce(name: str) -> float:
        dist.barrier(group=groups["gloo"])
        start = time.perf_counter()
        dist.all_reduce(grad, group=groups[name])
        return time.perf_counter() - start

    for name in groups:  # warm-up: bucket rebuild, connections, allocator
        step(name), step(name), reduce(name)
    for r in range(args.rounds):
        order = list(groups) if r % 2 == 0 else list(reversed(groups))
        for name in order:
            step_times[name] += [step(name) for _ in range(args.steps)]
            reduce_times[name].append(reduce(name))

    same = all(torch.equal(a, b) for a, b in zip(models["jacklring"].parameters(), models["gloo"].parameters()))
    if rank == 0:
        ms = {n: statistics.median(v) * 1e3 for n, v in step_times.items()}
        ar = {n: statistics.median(v) * 1e3 for n, v in reduce_times.items()}
        print(f"\nDDP step, {params / 1e6:.1f}M-parameter MLP, batch {args.batch}, {world} ranks on "
              f"{socket.gethostname()}, {torch.get_num_threads()} torch thread(s) per rank, "
              f"medians of {len(step_times['gloo'])} steps")
        print(f"{'backend':<10} {'step (ms)':>10} {'all_reduce 100 MB (ms)':>24} {'busbw (GB/s)':>13}")
        for name in groups:
            busbw = 2 * (world - 1) / world * params * 4 / (ar[name] / 1e3) / 1e9
            print(f"{name:<10} {ms[name]:>10.1f} {ar[name]:>24.1f} {busbw:>13.2f}")
        print(f"jacklring / gloo step time: {ms['jacklring'] / ms['gloo']:.3f}; "
              f"parameters identical after the run: {same}")
    dist.destroy_process_group()


def main() -> int:
    args = parse()
    if args.worker is None and "RANK" not in os.environ:
        return spawn(args)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
