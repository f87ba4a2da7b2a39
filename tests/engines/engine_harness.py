"""Helpers shared by the engine tests: start ranks the way an engine would, read their RESULT lines."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

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


class Lines:
    """A stream's lines, read by a thread as they come, so that a wait for one has a deadline
    (a readline() on a pipe has none) and the pipe never fills."""

    def __init__(self, stream) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def records(self) -> list[dict]:
        """The JSON object lines seen so far."""
        return [json.loads(line) for line in self.seen if line.startswith("{")]

    def wait_for(self, condition, what: str, timeout_s: float) -> list[dict]:
        """Read until condition(records()) is true; fails naming `what` at the deadline or at the
        stream's end."""
        deadline = time.monotonic() + timeout_s
        while not condition(self.records()):
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{what}: not within {timeout_s} s; seen:\n{self.text()}") from None
            if line is None:
                raise AssertionError(f"{what}: the stream ended first; seen:\n{self.text()}")
            self.seen.append(line)
        return self.records()

    def finish(self, timeout_s: float) -> str:
        """Everything, once the writer closed the stream (within timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the stream did not end within {timeout_s} s; seen:\n{self.text()}") from None
            if line is None:
                return self.text()
            self.seen.append(line)

    def text(self) -> str:
        return "".join(self.seen)
