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

import random
import tempfile
import time

from recovery_trials import arguments, job_env, kill_one, label, ranks, spread, start_rank

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
    env = job_env(n, transport, tmp)
    with ranks(RANK, env, n) as procs:
        victim, _ = kill_one(procs, rng)
        procs[victim].wait()
        survivors = [p for q, p in enumerate(procs) if q != victim]
        for p in survivors:
            assert p.stdout.readline().split()[:1] == ["SHRUNK"]
        started = time.monotonic()
        newcomer = start_rank(RANK, env, victim, JACKLRING_JOIN="1")
        procs.append(newcomer)
        expected = float(sum(q + 1 for q in range(n)))
        line = newcomer.stdout.readline().split()
        assert line[:1] == ["SUM"] and float(line[3]) == expected and line[4] == str(n), line
        for p in survivors:
            other = p.stdout.readline().split()
            assert other[:1] == ["SUM"] and float(other[3]) == expected, other
        return float(line[1]) - started, float(line[1]) - float(line[2])


def main() -> None:
    args = arguments(__doc__.split("\n\n")[0], trials=10)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        for transport in args.transport.split(","):
            results = [trial(args.ranks, transport, rng, tmp) for _ in range(args.trials)]
            for i, what in enumerate(("process start", "init() call")):
                print(f"{args.ranks} ranks, {label(transport)}, {args.trials} trials: replacement's {what} to its "
                      f"first correct all_sum on the grown group: {spread([r[i] for r in results])}", flush=True)


if __name__ == "__main__":
    main()
