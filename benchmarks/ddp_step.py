"""DDP training-step time with the jacklring backend vs gloo, in the same run.

    python benchmarks/ddp_step.py                        # spawns 2 local ranks, both models
    python benchmarks/ddp_step.py --model resnet18 --rounds 3
    torchrun --nproc-per-node 2 benchmarks/ddp_step.py

Models: a ~25M-parameter MLP (1024 -> 4096 -> 4096 -> 1024, float32) and a ResNet-18
(11.7M parameters, torchvision's layout written out here so torchvision is not needed) on
random 32x32 images. One DDP model per backend on the same ranks; rounds alternate between the
backends so both see the same machine load. Rank 0 prints medians of:

- step: forward + backward (gradient all-reduce overlapped by DDP) + SGD step;
- local: the same step under `no_sync()`: no communication at all, so `local / gloo step` is
  the best step ratio any backend could reach against gloo on this machine;
- backward: `loss.backward()` alone, under `no_sync()` (no communication);
- comm: the gradient all-reduce alone: the gradients in DDP's buckets (25 MiB, reverse
  parameter order), one async all-reduce per bucket, then waiting for all;
- overlapped: `loss.backward()` with DDP's hooks (backward and bucket all-reduces together;
  DDP's backward returns once every bucket is reduced).

`overlap` = (backward + comm - overlapped) / min(backward, comm): 1 when the communication
is hidden entirely behind the backward pass, 0 when nothing overlaps.
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
BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--model", default="mlp,resnet18", help="comma separated: mlp, resnet18")
    p.add_argument("--rounds", type=int, default=4, help="measured rounds (each: steps per backend)")
    p.add_argument("--steps", type=int, default=2, help="steps per backend per round")
    p.add_argument("--batch", type=int, default=32, help="MLP batch")
    p.add_argument("--image-batch", type=int, default=16, help="ResNet-18 batch (32x32 images)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / ranks)")
    p.add_argument("--timeout", type=float, default=600)
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


def mlp():
    from torch import nn
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1024))


def resnet18(classes: int = 1000):
    """ResNet-18 as torchvision lays it out (BasicBlock, [2, 2, 2, 2], 11.7M parameters)."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            out = self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))
            return (out + (x if self.down is None else self.down(x))).relu()

    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def buckets(params, cap: int = BUCKET_BYTES):
    """Gradient tensors flattened into DDP-like buckets (reverse parameter order, cap bytes)."""
    import torch
    groups, current, size = [], [], 0
    for p in reversed(list(params)):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return [torch.cat([p.detach().reshape(-1) for p in g]) for g in groups]


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

    for model_name in [m for m in args.model.split(",") if m]:
        if model_name == "mlp":
            make, x, y = mlp, torch.randn(args.batch, 1024), torch.randn(args.batch, 1024)
            loss_fn = nn.functional.mse_loss
            label = f"{model_name}, batch {args.batch}"
        elif model_name == "resnet18":
            make = resnet18
            x, y = torch.randn(args.image_batch, 3, 32, 32), torch.randint(0, 1000, (args.image_batch,))
            loss_fn = nn.functional.cross_entropy
            label = f"{model_name}, batch {args.image_batch} of 3x32x32"
        else:
            raise SystemExit(f"unknown model {model_name!r}")

        def build(g):
            torch.manual_seed(0)
            return DDP(make(), process_group=g)
        models = {name: build(g) for name, g in groups.items()}
        params = sum(p.numel() for p in models["gloo"].parameters())
        opts = {name: torch.optim.SGD(m.parameters(), lr=1e-4) for name, m in models.items()}
        wire = {name: buckets(m.parameters()) for name, m in models.items()}
        times: dict[str, dict[str, list[float]]] = {name: {k: [] for k in ("step", "local", "backward", "comm", "overlapped")}
                                                   for name in groups}

        def step(name: str) -> float:
            dist.barrier(group=groups["gloo"])
            start = time.perf_counter()
            opts[name].zero_grad()
            loss_fn(models[name](x), y).backward()
            opts[name].step()
            return time.perf_counter() - start

        def local_step(name: str) -> float:
            dist.barrier(group=groups["gloo"])
            start = time.perf_counter()
            opts[name].zero_grad()
            with models[name].no_sync():
                loss_fn(models[name](x), y).backward()
            opts[name].step()
            return time.perf_counter() - start

        def backward(name: str, sync: bool) -> float:
            model = models[name]
            opts[name].zero_grad()
            if sync:
                loss = loss_fn(model(x), y)
                dist.barrier(group=groups["gloo"])
                start = time.perf_counter()
                loss.backward()
                return time.perf_counter() - start
            with model.no_sync():
                loss = loss_fn(model(x), y)
                dist.barrier(group=groups["gloo"])
                start = time.perf_counter()
                loss.backward()
                return time.perf_counter() - start

        def comm(name: str) -> float:
            dist.barrier(group=groups["gloo"])
            start = time.perf_counter()
            works = [dist.all_reduce(b, group=groups[name], async_op=True) for b in wire[name]]
            for w in works:
                w.wait()
            return time.perf_counter() - start

        for name in groups:  # warm-up: bucket rebuild, connections, allocator
            step(name), step(name), comm(name), backward(name, False)
        for r in range(args.rounds):
            order = list(groups) if r % 2 == 0 else list(reversed(groups))
            for name in order:
                t = times[name]
                t["step"] += [step(name) for _ in range(args.steps)]
                t["local"] += [local_step(name) for _ in range(args.steps)]
                t["backward"] += [backward(name, False) for _ in range(args.steps)]
                t["comm"] += [comm(name) for _ in range(args.steps)]
                t["overlapped"] += [backward(name, True) for _ in range(args.steps)]

        same = all(torch.equal(a, b) for a, b in zip(models["jacklring"].parameters(), models["gloo"].parameters()))
        if rank == 0:
            ms = {n: {k: statistics.median(v) * 1e3 for k, v in t.items()} for n, t in times.items()}
            load = os.getloadavg()[0]
            print(f"\nDDP, {label}, {params / 1e6:.1f}M parameters ({len(wire['gloo'])} buckets), {world} ranks on "
                  f"{socket.gethostname()}, {torch.get_num_threads()} torch thread(s) per rank, medians of "
                  f"{len(times['gloo']['step'])}; load average {load:.1f}")
            print(f"{'backend':<10} {'step':>9} {'local':>9} {'backward':>9} {'comm':>9} {'overlapped':>11} {'overlap':>8}  (ms)")
            for name in groups:
                m = ms[name]
                hidden = (m["backward"] + m["comm"] - m["overlapped"]) / min(m["backward"], m["comm"])
                print(f"{name:<10} {m['step']:>9.1f} {m['local']:>9.1f} {m['backward']:>9.1f} {m['comm']:>9.1f} "
                      f"{m['overlapped']:>11.1f} {hidden:>8.2f}")
            floor = min(ms[n]["local"] for n in groups) / ms["gloo"]["step"]
            print(f"jacklring / gloo: step {ms['jacklring']['step'] / ms['gloo']['step']:.3f}, overlapped "
                  f"{ms['jacklring']['overlapped'] / ms['gloo']['overlapped']:.3f}; "
                  f"parameters identical after the run: {same}; a step with no communication would be "
                  f"{floor:.3f} of gloo's", flush=True)
        for held in (models, opts, wire):  # free this model before the next one is built
            held.clear()
    dist.destroy_process_group()


def main() -> int:
    args = parse()
    if args.worker is None and "RANK" not in os.environ:
        return spawn(args)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
