"""Spawn real rank processes for the torch backend tests: torch's own rendezvous (tcp:// on
127.0.0.1), no MLX_* variables, every process under a timeout."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass

import ranks
import zygote

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
    # Which torch process group runs is the one setting kept: the suite runs with either.
    if "JACKLRING_TORCH_NATIVE" in os.environ:
        env["JACKLRING_TORCH_NATIVE"] = os.environ["JACKLRING_TORCH_NATIVE"]
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
          port: int | None = None) -> list[subprocess.Popen | zygote.Process]:
    """n ranks of worker, forked by the zygote (tests/zygote.py); launches that run side by
    side take their ports from one free_ports() call (port=), so that they cannot draw the same one."""
    port = port or free_port()
    path = os.path.join(WORKERS, worker)
    return [zygote.popen([sys.executable, path, str(rank), str(n), str(port), *args], cwd=ROOT,
                             env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(n)]


def collect(procs: list[subprocess.Popen | zygote.Process], timeout: float) -> list[Result]:
    return ranks.collect(procs, timeout, make=Result)


def run(n: int, worker: str, *args: str, timeout: float = 60, env: dict[str, str] | None = None) -> list[Result]:
    return collect(spawn(n, worker, *args, env=env), timeout)


def assert_all_ok(results: list[Result], marker: str = "ALL OK") -> None:
    bad = [r for r in results if r.returncode != 0 or marker not in r.stdout]
    assert not bad, "\n".join(r.report() for r in results)


def launch_parts(n: int, parts: tuple[str, ...], timeout: float) -> list[Result]:
    """n ranks of workers/parts.py running the scripts of parts ("SCRIPT" or "SCRIPT:ARG") one
    after the other in each rank process, each part on a port of its own: a part's group forms
    on a port no store of an earlier part holds."""
    port, *ports = free_ports(1 + len(parts))
    specs = []
    for part, p in zip(parts, ports):
        script, _, arg = part.partition(":")
        specs.append(f"{script}:{p}" + (f":{arg}" if arg else ""))
    return collect(spawn(n, "parts.py", *specs, port=port), timeout)


def section(text: str, name: str) -> str:
    """The part of a rank's output from its "=== name" line to the next "=== " line; "" if none."""
    start = text.find(f"=== {name}\n")
    if start < 0:
        return ""
    end = text.find("\n=== ", start + 1)
    return text[start:] if end < 0 else text[start:end + 1]


def part(results: list[Result], name: str, *markers: str) -> list[Result]:
    """Each rank's output of one part of launch_parts (from "=== SCRIPT [ARG]" to the next part),
    after checking that every rank printed the markers there and exited 0, or 1 for another
    part's failure (never a signal or a crash at exit). A failure names the part."""
    name = name.replace(":", " ")
    parts = [dataclasses.replace(r, stdout=section(r.stdout, name)) for r in results]
    bad = [p for p, r in zip(parts, results)
           if not all(m in p.stdout for m in markers)
           or not (r.returncode == 0 or (r.returncode == 1 and " FAILED\n" in r.stdout))]
    assert not bad, f"{name}:\n" + "\n".join(r.report() for r in results)
    return parts
