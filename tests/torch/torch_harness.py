"""Spawn real rank processes for the torch backend tests: torch's own rendezvous (tcp:// on
127.0.0.1), no MLX_* variables, every process under a timeout."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import ranks

from adapter.bench import free_ports

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKERS = os.path.join(HERE, "workers")
VENV_BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    return free_ports(1)[0]  # below the ephemeral range: no client can take it meanwhile


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without launcher / backend variables that would change what runs."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLX_", "JACKLRING_", "OMPI_", "PMIX_", "PMI_", "MASTER_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", JACKLRING_CONNECT_TIMEOUT="30")
    env.update(extra)
    return env


@dataclass
class Result:
    rank: int
    returncode: int
    stdout: str
    stderr: str

    def report(self) -> str:
        return f"--- rank {self.rank} exit {self.returncode}\n{self.stdout[-3000:]}\n{self.stderr[-6000:]}"


def spawn(n: int, worker: str, *args: str, env: dict[str, str] | None = None,
          port: int | None = None) -> list[subprocess.Popen]:
    """n ranks of worker; launches that run side by side take their ports from one
    free_ports() call (port=), so that they cannot draw the same one."""
    port = port or free_port()
    path = os.path.join(WORKERS, worker)
    return [subprocess.Popen([sys.executable, path, str(rank), str(n), str(port), *args], cwd=ROOT,
                             env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(n)]


def collect(procs: list[subprocess.Popen], timeout: float) -> list[Result]:
    return ranks.collect(procs, timeout, make=Result)


def run(n: int, worker: str, *args: str, timeout: float = 60, env: dict[str, str] | None = None) -> list[Result]:
    return collect(spawn(n, worker, *args, env=env), timeout)


def assert_all_ok(results: list[Result], marker: str = "ALL OK") -> None:
    bad = [r for r in results if r.returncode != 0 or marker not in r.stdout]
    assert not bad, "\n".join(r.report() for r in results)
