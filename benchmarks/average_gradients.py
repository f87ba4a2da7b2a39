"""Benchmark: what packing buys average_gradients, on 2 ring ranks over loopback.

    python benchmarks/average_gradients.py            # spawns 2 ranks, prints two tables
    python benchmarks/average_gradients.py -n 3 --rounds 15
    launcher -n 2 benchmarks/average_gradients.py --launched     # ranks started by an engine
    torchrun --nproc-per-node 2 benchmarks/average_gradients.py --launched

--launched measures with the engine's own thread settings (the launcher's and torchrun's
OMP_NUM_THREADS); the spawned form pins one intra-op thread per rank.

(a) a ResNet-50 gradient set (161 tensors, 25.6M float32): average_gradients against one
    all_sum of a single buffer with the same number of bytes (the floor packing can reach);
(b) 2,000 tensors of 1,000 float32: average_gradients against one all_sum per tensor.

Variants run in interleaved rounds (so machine noise hits each alike); the tables give the
median over rounds of the slowest rank's time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from adapter.bench import free_ports

REPO = Path(__file__).resolve().parent.parent


def resnet50_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision's ResNet-50 (conv weights, batch-norm scale and shift, fc)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    channels = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            shapes += [(width, channels, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (4 * width, width, 1, 1), (4 * width,), (4 * width,)]
            if block == 0:
                shapes += [(4 * width, channels, 1, 1), (4 * width,), (4 * width,)]
            channels = 4 * width
    return shapes + [(1000, 2048), (1000,)]


def time_it(fn, barrier) -> float:
    barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def worker(rounds: int, out: str, pin_threads: bool = True) -> None:
    import numpy as np
    import torch

    import adapter
    from adapter.gradients import average_gradients

    if pin_threads:
        torch.set_num_threads(1)
    group = adapter.init(strict=True)
    barrier = adapter.barrier
    gen = torch.Generator().manual_seed(group.rank())

    resnet = [torch.randn(s, generator=gen) for s in resnet50_shapes()]
    resnet_elems = sum(t.numel() for t in resnet)
    one_buffer = torch.randn(resnet_elems, generator=gen)
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros_like(t)) for t in resnet])
    for p, t in zip(model.parameters(), resnet):
        p.grad = t.clone()
    small = [torch.randn(1000, generator=gen) for _ in range(2000)]
    small_buffer = torch.randn(2000 * 1000, generator=gen)

    variants = {
        "a: average_gradients(list of 161 tensors)": lambda: average_gradients(resnet),
        "a: average_gradients(Module, in place)": lambda: average_gradients(model),
        "a: all_sum(one buffer, same bytes)": lambda: adapter.all_sum(one_buffer),
        "b: average_gradients(2000 x 1000)": lambda: average_gradients(small),
        "b: all_sum per tensor (2000 calls)": lambda: [adapter.all_sum(t) for t in small],
        "b: all_sum(one buffer, same bytes)": lambda: adapter.all_sum(small_buffer),
    }
    for fn in variants.values():  # warm up connections, page in buffers
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(time_it(fn, barrier))
    # The job takes as long as its slowest rank: keep the max over ranks per round.
    slowest = {name: adapter.all_max(np.array(ts)).tolist() for name, ts in times.items()}
    if group.rank() == 0:
        Path(out).write_text(json.dumps({"size": group.size(), "elements": resnet_elems,
                                         "tensors": len(resnet), "times": slowest}))


def launch(ranks: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp, "hosts.json")
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(ranks)]))
        out = Path(tmp, "result.json")
        env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--rounds", str(rounds), "--out", str(out)],
                                  env={**env, "MLX_RANK": str(r)}) for r in range(ranks)]
        try:
            codes = [p.wait(timeout=600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            sys.exit(f"a rank failed (exit codes {codes})")
        return json.loads(out.read_text())


def report(result: dict) -> None:
    med = {name: statistics.median(ts) for name, ts in result["times"].items()}
    mib = result["elements"] * 4 / 2**20
    print(f"\n{result['size']} ranks, ring backend, loopback; median over rounds of the slowest rank\n")
    print(f"(a) ResNet-50 gradients: {result['tensors']} float32 tensors, {result['elements'] / 1e6:.1f}M elements, {mib:.0f} MiB")
    base = med["a: all_sum(one buffer, same bytes)"]
    rows = [(n, med[n], med[n] / base) for n in med if n.startswith("a:")]
    print(f"| {'variant':44} | {'time':>9} | {'vs one all_sum':>14} |")
    print(f"|{'-' * 46}|{'-' * 11}|{'-' * 16}|")
    for name, t, ratio in rows:
        print(f"| {name[3:]:44} | {t * 1e3:6.1f} ms | {ratio:13.2f}x |")
    print("\n(b) 2,000 tensors of 1,000 float32 (7.6 MiB)")
    slow = med["b: all_sum per tensor (2000 calls)"]
    print(f"| {'variant':44} | {'time':>9} | {'speed-up':>14} |")
    print(f"|{'-' * 46}|{'-' * 11}|{'-' * 16}|")
    for name in ("b: all_sum per tensor (2000 calls)", "b: average_gradients(2000 x 1000)",
                 "b: all_sum(one buffer, same bytes)"):
        print(f"| {name[3:]:44} | {med[name] * 1e3:6.1f} ms | {slow / med[name]:13.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--launched", action="store_true",
                        help="this process is a rank started by launcher/torchrun/srun (rank 0 prints)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.launched:
        import torch

        out = Path(tempfile.gettempdir(), f"average_gradients-{os.getpid()}.json")
        worker(args.rounds, str(out), pin_threads=False)
        if out.exists():
            print(f"intra-op threads per rank: {torch.get_num_threads()} "
                  f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")
            report(json.loads(out.read_text()))
            out.unlink()
    elif args.worker:
        sys.path.insert(0, str(REPO))
        worker(args.rounds, args.out)
    else:
        report(launch(args.n, args.rounds))


if __name__ == "__main__":
    main()
