"""How long a replacement takes to join a ring or JACCL job: from its start to its first correct
collective on the group Group.grow() returned.

    python benchmarks/grow_recovery.py                     # 4 ranks, 10 trials, TCP and shared memory
    python benchmarks/grow_recovery.py --ranks 3 --trials 5 --transport tcp
    python benchmarks/grow_recovery.py --engine hostfile,env --transport tcp
    python benchmarks/grow_recovery.py --engine jaccl --ranks 3 --trials 5 --transport tcp

Each trial starts N ring ranks on 127.0.0.1 looping all_sum of 4096 float32, kills a random
rank with SIGKILL, and waits until the survivors have shrunk and called grow(). Then it starts
the replacement (JACKLRING_JOIN=1, the dead rank's MLX_RANK), as the launcher's
--restart-failed does, and reads the moment (CLOCK_MONOTONIC, system-wide) the replacement's
first all_sum on the grown group returned the right sum (every rank adds its slot + 1). Two
times per trial: from the process start (Popen: the interpreter, numpy and adapter's imports
included), and from its init() call (the join itself). min / median / max over the trials.

--engine env forms the group through torch's env:// store instead (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; torch is imported by every rank) and the replacement knocks there
(adapter/rendezvous/store_grow.py); the victim is then never rank 0, whose process serves the
store. --engine jaccl runs JACCL on its TCP mesh (MLX_JACCL_COORDINATOR, a device file without
RDMA devices), whose replacement knocks at the coordinator address (adapter/backends/jaccl/grow.py);
the victim is never rank 0 there either: only its process can recruit.
"""
from __future__ import annotations

import random
import signal
import tempfile
import time

from recovery_trials import arguments, free_ports, job_env, kill_one, label, ranks, spread, start_rank

RANK = r"""
import os, sys, time
import numpy as np
import adapter
slot = int(os.environ["MLX_RANK"])
called = time.monotonic()
backend = "jaccl" if os.environ.get("MLX_JACCL_COORDINATOR") else "ring" if os.environ.get("MLX_HOSTFILE") else "any"
group = adapter.init(strict=True, backend=backend)
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


def engine_env(engine: str, n: int, transport: str, tmp: str) -> dict[str, str]:
    env = job_env(n, transport, tmp, backend="jaccl" if engine == "jaccl" else "ring")
    if engine == "env":
        del env["MLX_HOSTFILE"]
        env.update(WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]))
    return env


def trial(engine: str, n: int, transport: str, rng: random.Random, tmp: str) -> tuple[float, float]:
    env = engine_env(engine, n, transport, tmp)
    with ranks(RANK, env, n) as procs:
        if engine in ("env", "jaccl"):  # rank 0 serves the store, or recruits JACCL's newcomers: it must live
            time.sleep(rng.uniform(0.0, 0.3))
            victim = rng.randrange(1, n)
            procs[victim].send_signal(signal.SIGKILL)
        else:
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
    args = arguments(__doc__.split("\n\n")[0], trials=10, engines=True)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engine.split(","):
            for transport in args.transport.split(","):
                results = [trial(engine, args.ranks, transport, rng, tmp) for _ in range(args.trials)]
                for i, what in enumerate(("process start", "init() call")):
                    print(f"{args.ranks} ranks, {engine}, {label(transport)}, {args.trials} trials: replacement's "
                          f"{what} to its first correct all_sum on the grown group: "
                          f"{spread([r[i] for r in results])}", flush=True)


if __name__ == "__main__":
    main()
