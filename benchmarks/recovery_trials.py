"""The trial scaffolding shared by shrink_recovery.py and grow_recovery.py: N ring ranks on
127.0.0.1 (one hostfile, the environment, one `python -c RANK` process per rank), a random
rank killed with SIGKILL once all print READY, every process reaped at the end, and the
command line and min / median / max line of both benchmarks."""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from adapter.bench import free_ports  # noqa: E402


def job_env(n: int, transport: str, tmp: str, backend: str = "ring") -> dict[str, str]:
    """This environment without inherited backend settings, plus JACKLRING_LOCAL_TRANSPORT=
    transport (tcp, or auto: shared memory) and what n ranks of `backend` share: a fresh
    hostfile (ring), or a device file without RDMA devices and a coordinator (JACCL's TCP mesh;
    BENCH_BACKEND names the backend for the rank script)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "JACKLRING_"))}
    env.update(PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", BENCH_BACKEND=backend,
               JACKLRING_TIMEOUT="30", JACKLRING_CONNECT_TIMEOUT="30", JACKLRING_LOCAL_TRANSPORT=transport)
    if backend == "ring":
        hostfile = os.path.join(tmp, "hosts.json")
        with open(hostfile, "w") as f:
            json.dump([[f"127.0.0.1:{p}"] for p in free_ports(n)], f)
        env["MLX_HOSTFILE"] = hostfile
        return env
    devices = os.path.join(tmp, "devices.json")
    with open(devices, "w") as f:
        json.dump([[None] * n for _ in range(n)], f)
    env.update(MLX_IBV_DEVICES=devices, MLX_JACCL_COORDINATOR=f"127.0.0.1:{free_ports(1)[0]}",
               JACKLRING_JACCL_TRANSPORT="tcp")
    return env


def start_rank(script: str, env: dict[str, str], rank: int, **extra: str) -> subprocess.Popen:
    ranks = {"MLX_RANK": str(rank), **({"RANK": str(rank)} if "WORLD_SIZE" in env else {})}  # env://: RANK too
    return subprocess.Popen([sys.executable, "-c", script], env={**env, **ranks, **extra},
                            stdout=subprocess.PIPE, text=True)


@contextmanager
def ranks(script: str, env: dict[str, str], n: int) -> Iterator[list[subprocess.Popen]]:
    """Ranks 0..n-1 of `script`, every one of them ready (it printed READY); on exit each
    process still in the list (a test may append more) is waited for, then killed."""
    procs = [start_rank(script, env, r) for r in range(n)]
    try:
        for p in procs:
            assert p.stdout.readline().split()[:1] == ["READY"]
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def kill_one(procs: list[subprocess.Popen], rng: random.Random) -> tuple[int, float]:
    """SIGKILL a random rank after a random 0-0.3 s; its rank and the moment of the kill."""
    time.sleep(rng.uniform(0.0, 0.3))
    victim = rng.randrange(len(procs))
    killed_at = time.monotonic()
    procs[victim].send_signal(signal.SIGKILL)
    return victim, killed_at


def arguments(description: str, trials: int, backends: bool = False, engines: bool = False,
              apis: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--trials", type=int, default=trials)
    parser.add_argument("--transport", default="tcp,auto", help="comma-separated: tcp, auto (shared memory)")
    parser.add_argument("--seed", type=int, default=24)
    if backends:
        parser.add_argument("--backend", default="ring", help="comma-separated: ring, jaccl (its TCP mesh)")
    if engines:
        parser.add_argument("--engine", default="hostfile",
                            help="comma-separated: hostfile (MLX_HOSTFILE), env (torch's env:// store), "
                                 "jaccl (JACCL's TCP mesh, its coordinator)")
    if apis:
        parser.add_argument("--api", default="numpy",
                            help="comma-separated: numpy (adapter.init, all_sum, Group.shrink), torch "
                                 "(init_process_group, dist.all_reduce, dist.shrink_group)")
    return parser.parse_args()


def label(transport: str) -> str:
    return "shared memory" if transport == "auto" else transport


def spread(times: list[float]) -> str:
    return f"min {min(times):.3f} s, median {statistics.median(times):.3f} s, max {max(times):.3f} s"
