"""How long a replacement takes to join a ring job: from its start to its first correct
collective on the group Group.grow() returned.

    python benchmarks/grow_recovery.py                     # 4 ranks, 10 trials, TCP and shared memory
    python benchmarks/grow_recovery.py --ranks 3 --trials 5 --transport tcp

Each trial starts N ring ranks on 127.0.0.1 looping all_sum of 4096 float32, kills a random
rank with SIGKILL, and waits until the survivors have shrunk and called grow(). Then it starts
the replacement (JACKLRING_JOIN=1, the dead rank's MLX_RANK), as the launcher's
--restart-failed does, and reads the moment (CLOCK_MONOTONIC, system-wide) the replacement's
first all_sum on the grown group returned the right sum (every rank adds its slot + 1). Two
times per trial: from the process start (Popen: the interpreter, numpy and adapter's imports
included), and from its init() call (the join itself). min / median / max over the trials.
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
slot = int(os.environ["MLX_RANK"])
called = time.monotonic()
group = adapter.init(strict=True, backend="ring")
if os.environ.get("JACKLRING_JOIN") != "1":
    x = np.full(4096, 1.0, np.float32)
    adapter.all_sum(x)
    print("READY", flush=True)
    try:
        while True:
            adapter.all_sum(x)
    except adapter.DistributedError:
        pass
    group = group.shrink(timeout=5)
    print("SHRUNK", flush=True)
    group = group.grow(timeout=30)
y = adapter.all_sum(np.full(4096, float(slot + 1), np.float32))
print("SUM", f"{time.monotonic():.6f}", f"{called:.6f}", float(y[0]), group.size(), flush=True)
"""


def trial(n: int, transport: str, rng: random.Random, tmp: str) -> tuple[float, float]:
    ports = free_ports(n)
    hostfile = os.path.join(tmp, "hosts.json")
    with open(hostfile, "w") as f:
        json.dump([[f"127.0.0.1:{p}"] for p in ports], f)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "JACKLRING_"))}
    env.update(PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MLX_HOSTFILE=hostfile,
               JACKLRING_TIMEOUT="30", JACKLRING_CONNECT_TIMEOUT="30", JACKLRING_LOCAL_TRANSPORT=transport)
    procs = [subprocess.Popen([sys.executable, "-c", RANK], env={**env, "MLX_RANK": str(r)},
                              stdout=subprocess.PIPE, text=True) for r in range(n)]
    try:
        for p in procs:
            assert p.stdout.readline().split()[:1] == ["READY"]
        time.sleep(rng.uniform(0.0, 0.3))
        victim = rng.randrange(n)
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait()
        survivors = [p for q, p in enumerate(procs) if q != victim]
        for p in survivors:
            assert p.stdout.readline().split()[:1] == ["SHRUNK"]
        started = time.monotonic()
        newcomer = subprocess.Popen([sys.executable, "-c", RANK],
                                    env={**env, "MLX_RANK": str(victim), "JACKLRING_JOIN": "1"},
                                    stdout=subprocess.PIPE, text=True)
        procs.append(newcomer)
        expected = float(sum(q + 1 for q in range(n)))
        line = newcomer.stdout.readline().split()
        assert line[:1] == ["SUM"] and float(line[3]) == expected and line[4] == str(n), line
        for p in survivors:
            other = p.stdout.readline().split()
            assert other[:1] == ["SUM"] and float(other[3]) == expected, other
        return float(line[1]) - started, float(line[1]) - float(line[2])
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
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--transport", default="tcp,auto", help="comma-separated: tcp, auto (shared memory)")
    parser.add_argument("--seed", type=int, default=24)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        for transport in args.transport.split(","):
            results = [trial(args.ranks, transport, rng, tmp) for _ in range(args.trials)]
            label = "shared memory" if transport == "auto" else transport
            for i, what in enumerate(("process start", "init() call")):
                times = [r[i] for r in results]
                print(f"{args.ranks} ranks, {label}, {args.trials} trials: replacement's {what} to its first "
                      f"correct all_sum on the grown group: min {min(times):.3f} s, median "
                      f"{statistics.median(times):.3f} s, max {max(times):.3f} s", flush=True)


if __name__ == "__main__":
    main()
