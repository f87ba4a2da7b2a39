"""How long a job takes to carry on after kill -9 of a rank: from the kill to the first correct
all_sum on the group Group.shrink() returned, on the ring and on JACCL's TCP mesh.

    python benchmarks/shrink_recovery.py                     # 4 ranks, 20 trials, TCP and shared memory
    python benchmarks/shrink_recovery.py --ranks 3 --trials 5 --transport tcp
    python benchmarks/shrink_recovery.py --backend ring,jaccl --trials 10

Each trial starts N ranks of the backend on 127.0.0.1 looping all_sum of 4096 float32 (shared memory:
JACKLRING_LOCAL_TRANSPORT=auto; TCP: tcp), kills a random rank (any, the coordinator
included) with SIGKILL after a random 0-0.3 s, and reads from
each survivor the moment (CLOCK_MONOTONIC, system-wide) its first all_sum on the shrunk group
returned the right sum. The trial's time is the slowest survivor's; min / median / max over
the trials are printed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from adapter.bench import free_ports  # noqa: E402

RANK = r"""
import os, sys, time
import numpy as np
import adapter
group = adapter.init(strict=True, backend=os.environ["BENCH_BACKEND"])
r, n = group.rank(), group.size()
x = np.full(4096, 1.0, np.float32)
adapter.all_sum(x)
print("READY", flush=True)
try:
    while True:
        adapter.all_sum(x)
except adapter.DistributedError:
    pass
new = group.shrink(timeout=5)
y = adapter.all_sum(np.full(4096, float(r + 1), np.float32))
print("SUM", f"{time.monotonic():.6f}", float(y[0]), flush=True)
"""


def backend_env(backend: str, n: int, tmp: str) -> dict[str, str]:
    """The variables every rank of `backend` shares (MLX_RANK aside)."""
    if backend == "ring":
        hostfile = os.path.join(tmp, "hosts.json")
        with open(hostfile, "w") as f:
            json.dump([[f"127.0.0.1:{p}"] for p in free_ports(n)], f)
        return {"MLX_HOSTFILE": hostfile}
    devices = os.path.join(tmp, "devices.json")  # no RDMA device: JACCL's TCP mesh
    with open(devices, "w") as f:
        json.dump([[None] * n for _ in range(n)], f)
    return {"MLX_IBV_DEVICES": devices, "MLX_JACCL_COORDINATOR": f"127.0.0.1:{free_ports(1)[0]}",
            "JACKLRING_JACCL_TRANSPORT": "tcp"}


def trial(backend: str, n: int, transport: str, rng: random.Random, tmp: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "JACKLRING_"))}
    env.update(PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", BENCH_BACKEND=backend,
               JACKLRING_TIMEOUT="30", JACKLRING_CONNECT_TIMEOUT="30", JACKLRING_LOCAL_TRANSPORT=transport,
               **backend_env(backend, n, tmp))
    procs = [subprocess.Popen([sys.executable, "-c", RANK], env={**env, "MLX_RANK": str(r)},
                              stdout=subprocess.PIPE, text=True) for r in range(n)]
    try:
        for p in procs:
            assert p.stdout.readline().split()[:1] == ["READY"]
        time.sleep(rng.uniform(0.0, 0.3))
        victim = rng.randrange(n)
        killed_at = time.monotonic()
        procs[victim].send_signal(signal.SIGKILL)
        expected = float(sum(q + 1 for q in range(n) if q != victim))
        done = []
        for q, p in enumerate(procs):
            if q == victim:
                continue
            line = p.stdout.readline().split()
            assert line[:1] == ["SUM"] and float(line[2]) == expected, (q, line)
            done.append(float(line[1]))
        return max(done) - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--transport", default="tcp,auto", help="comma-separated: tcp, auto (shared memory)")
    parser.add_argument("--backend", default="ring", help="comma-separated: ring, jaccl (its TCP mesh)")
    parser.add_argument("--seed", type=int, default=24)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backend.split(","):
            for transport in args.transport.split(","):
                rng = random.Random(args.seed)  # the same victims and moments for every backend
                times = [trial(backend, args.ranks, transport, rng, tmp) for _ in range(args.trials)]
                label = "shared memory" if transport == "auto" else transport
                print(f"{backend}, {args.ranks} ranks, {label}, {args.trials} trials: kill -9 to the first correct "
                      f"all_sum on the shrunk group: min {min(times):.3f} s, median {statistics.median(times):.3f} s, "
                      f"max {max(times):.3f} s", flush=True)


if __name__ == "__main__":
    main()
