"""Helpers shared by the engine tests: start ranks the way an engine would, read their RESULT lines."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import ranks
import zygote

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RANK_SCRIPT = os.path.join(HERE, "engine_rank.py")
VENV_BIN = os.path.dirname(sys.executable)

# Variables of other engines that the test process itself may carry: a test sets only its own.
ENGINE_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "MLX_RANK", "MLX_HOSTFILE", "MLX_IBV_DEVICES", "MLX_JACCL_COORDINATOR", "NCCL_HOST_IP",
                    "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ENGINE_VARIABLES and not k.startswith(("SLURM_", "OMPI_", "PMIX_", "PMI_"))}
    env.update(PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", JACKLRING_CONNECT_TIMEOUT="20", JACKLRING_TIMEOUT="30")
    env.update(extra)
    return env


def results(text: str) -> list[dict]:
    """Every RESULT line's fields, sorted by rank."""
    found = [json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines() if "RESULT {" in line]
    return sorted(found, key=lambda r: r["rank"])


def run(cmd: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def spawn_ranks(n: int, mode: str, env_for_rank, timeout: float = 60) -> list[subprocess.CompletedProcess]:
    """n processes of engine_rank.py MODE, each with env_for_rank(r); waits for all."""
    # Forked by the zygote (tests/zygote.py): the ranks import torch for its store, most of their start
    procs = [zygote.popen([sys.executable, RANK_SCRIPT, mode], env=env_for_rank(r), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    return ranks.collect(procs, timeout,
                         make=lambda i, code, out, err: subprocess.CompletedProcess(procs[i].args, code, out, err))


def describe(procs) -> str:
    return "\n".join(f"--- exit {p.returncode}\n{p.stdout}\n{p.stderr}" for p in procs)
