"""The one way tests start ranks: the real launcher (`python -m launcher.cli`), as a user would.

launch() runs `launcher [ARGS] command...` with an environment free of any backend settings
inherited from the test process, Open MPI set up for root on loopback, and short deadlines so
that a stuck rank fails the test instead of hanging it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = [sys.executable, "-m", "launcher.cli"]
INHERITED_PREFIXES = ("MLX_", "JACKLRING_", "NCCL_", "OMPI_", "PMIX_", "PMI_", "PRTE_")
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_btl_tcp_if_include": "lo",
    # Only the transports one machine needs: probing ofi/uct costs about a second per launch.
    "OMPI_MCA_btl": "self,sm,tcp",
    # Ranks waiting in MPI yield the CPU: with more ranks than cores, busy polling made each
    # MPI call wait for a scheduler time slice (tens of ms).
    "OMPI_MCA_mpi_yield_when_idle": "1",
}


def launch_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_PREFIXES) and k != "MPI_LOCALNRANKS"}
    env.update(MPI_ENV)
    env.update(JACKLRING_TIMEOUT="30", JACKLRING_CONNECT_TIMEOUT="30", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def launch(args: Sequence[str], timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`launcher *args` from the repository root; raises subprocess.TimeoutExpired past timeout."""
    return subprocess.run([*LAUNCHER, *args], capture_output=True, text=True, timeout=timeout,
                          env=launch_env(**(env or {})), cwd=REPO)


def local_hostfile(path: Path, backend: str, ranks: int, rdma: list[list[str | None]] | None = None,
                   ips: Sequence[str] = ("127.0.0.1",)) -> Path:
    """A launcher hostfile of `ranks` hosts on this machine (ssh never used for 127.0.0.1)."""
    hosts = [{"ssh": "127.0.0.1", "ips": list(ips)} for _ in range(ranks)]
    for host, row in zip(hosts, rdma or []):
        host["rdma"] = row
    path.write_text(json.dumps({"backend": backend, "hosts": hosts}))
    return path


def output_tail(result: subprocess.CompletedProcess, chars: int = 3000) -> str:
    return f"--- launcher exit {result.returncode}\n--- stdout\n{result.stdout[-chars:]}\n--- stderr\n{result.stderr[-chars:]}"
