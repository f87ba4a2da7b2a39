"""How long a job takes to carry on after kill -9 of a rank: from the kill to the first correct
all_sum on the group Group.shrink() returned, on the ring and on JACCL's TCP mesh.

    python benchmarks/shrink_recovery.py                     # 4 ranks, 20 trials, TCP and shared memory
    python benchmarks/shrink_recovery.py --ranks 3 --trials 5 --transport tcp
    python benchmarks/shrink_recovery.py --backend ring,jaccl --trials 10
    python benchmarks/shrink_recovery.py --api torch --ranks 8     # dist.all_reduce, dist.shrink_group

Each trial starts N ranks of the backend on 127.0.0.1 looping all_sum of 4096 float32 (shared memory:
JACKLRING_LOCAL_TRANSPORT=auto; TCP: tcp), kills a random rank (any, the coordinator
included) with SIGKILL after a random 0-0.3 s, and reads from
each survivor the moment (CLOCK_MONOTONIC, system-wide) its first all_sum on the shrunk group
returned the right sum. The trial's time is the slowest survivor's; min / median / max over
the trials are printed. With --api torch the ranks form the torch process group "jacklring"
instead (torch's env:// variables; the ring forms through the store in rank 0's process, or
JACCL's TCP mesh with --backend jaccl), loop dist.all_reduce, and call
dist.shrink_group([culprit]) on the rank the failure names, as docs/torch.md's recipe does.
"""
from __future__ import annotations

import random
import tempfile

from recovery_trials import arguments, free_ports, job_env, kill_one, label, ranks, spread

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

TORCH_RANK = r"""
import os, sys, time
import torch
import torch.distributed as dist
import adapter
dist.init_process_group("jacklring")
r = dist.get_rank()
x = torch.ones(4096)
dist.all_reduce(x)
print("READY", flush=True)
try:
    while True:
        x.fill_(1.0)
        dist.all_reduce(x)
except Exception as e:  # torch re-raises the backend's error
    culprit = adapter.culprit_of(e)
dist.shrink_group([culprit])
y = torch.full((4096,), float(r + 1))
dist.all_reduce(y)
print("SUM", f"{time.monotonic():.6f}", float(y[0]), flush=True)
"""


def torch_env(env: dict[str, str], n: int, backend: str) -> dict[str, str]:
    """The torch group's variables on top of job_env's: env:// with a fresh port; the group's
    backend is the ring through the store, or JACCL from job_env's variables."""
    env = {**env, "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0])}
    env.pop("MLX_HOSTFILE", None)
    if backend == "jaccl":
        env["JACKLRING_TORCH_BACKEND"] = "jaccl"
    return env


def trial(api: str, backend: str, n: int, transport: str, rng: random.Random, tmp: str) -> float:
    env = job_env(n, transport, tmp, backend)
    script = RANK if api == "numpy" else TORCH_RANK
    if api == "torch":
        env = torch_env(env, n, backend)
    with ranks(script, env, n) as procs:
        victim, killed_at = kill_one(procs, rng)
        expected = float(sum(q + 1 for q in range(n) if q != victim))
        done = []
        for q, p in enumerate(procs):
            if q == victim:
                continue
            line = p.stdout.readline().split()
            assert line[:1] == ["SUM"] and float(line[2]) == expected, (q, line)
            done.append(float(line[1]))
        return max(done) - killed_at


def main() -> None:
    args = arguments(__doc__.split("\n\n")[0], trials=20, backends=True, apis=True)
    with tempfile.TemporaryDirectory() as tmp:
        for api in args.api.split(","):
            for backend in args.backend.split(","):
                for transport in args.transport.split(","):
                    rng = random.Random(args.seed)  # the same victims and moments for every backend
                    times = [trial(api, backend, args.ranks, transport, rng, tmp) for _ in range(args.trials)]
                    call = "all_sum" if api == "numpy" else "dist.all_reduce"
                    print(f"{api}, {backend}, {args.ranks} ranks, {label(transport)}, {args.trials} trials: kill -9 "
                          f"to the first correct {call} on the shrunk group: {spread(times)}", flush=True)


if __name__ == "__main__":
    main()
