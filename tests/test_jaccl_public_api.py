"""JACCL through the real launcher and the public API, as a user runs it: `launcher --backend
jaccl -n N` on one machine (a device matrix of nulls: TCP mesh), jaccl-ring from a hostfile
with only ring links, a group of one, and faults (one clear error, non-zero exit naming a rank).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "tests" / "jaccl_scripts"
LAUNCHER = [sys.executable, "-m", "launcher.cli"]


def launch(*args: str, timeout: float = 80, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "JACKLRING_", "NCCL_", "OMPI_", "PMIX_"))}
    clean.pop("CUDA_VISIBLE_DEVICES", None)
    clean.update(JACKLRING_TIMEOUT="30", JACKLRING_CONNECT_TIMEOUT="30",
                 PYTHONPATH=str(REPO) + os.pathsep + clean.get("PYTHONPATH", ""))
    clean.update(env)
    return subprocess.run([*LAUNCHER, *args], capture_output=True, text=True, timeout=timeout, env=clean, cwd=REPO)


def done_ranks(result: subprocess.CompletedProcess) -> list[str]:
    return sorted(line.split("] ", 1)[1] for line in result.stdout.splitlines() if "] DONE rank" in line)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [1, 3])
def test_local_launch_without_a_hostfile_runs_every_public_op(n):
    """launcher -n N writes a matrix of nulls: formerly a ConfigError (no links), and a group
    of one was refused; now a full TCP mesh, and a group of one."""
    r = launch("--backend", "jaccl", "-n", str(n), str(SCRIPTS / "public_api.py"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert done_ranks(r) == [f"DONE rank {i} of {n} failures=[]" for i in range(n)]


@pytest.mark.timeout(90)
def test_ring_only_hostfile_sends_between_any_ranks(tmp_path):
    """Ring mode from a ring-only hostfile (4 ranks, so 0 <-> 2 are not neighbours): the TCP
    transport connects every pair, so send/recv reach any rank (formerly refused)."""
    n = 4
    rows = [[None if i == j or (j - i) % n not in (1, n - 1) else f"d{min(i, j)}{max(i, j)}" for j in range(n)]
            for i in range(n)]
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps({"backend": "jaccl-ring", "hosts": [
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1"], "rdma": row} for row in rows]}))
    r = launch("--hostfile", str(hostfile), str(SCRIPTS / "public_api.py"), JACKLRING_JACCL_TRANSPORT="tcp")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert done_ranks(r) == [f"DONE rank {i} of {n} failures=[]" for i in range(n)]


@pytest.mark.timeout(60)
def test_rdma_forced_with_a_matrix_of_nulls_says_no_device_is_named():
    r = launch("--backend", "jaccl", "-n", "2", str(SCRIPTS / "public_api.py"), timeout=50,
               JACKLRING_JACCL_TRANSPORT="rdma")
    assert r.returncode != 0
    assert "names no RDMA device" in r.stdout + r.stderr


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault, words", [
    ("dtype", "MismatchError"),
    ("op", "MismatchError"),
    ("dead", "rank 1 (host 127.0.0.1) exited with code 3"),  # the others may be stopped before they report
    ("p2p", "MismatchError"),
    ("raise", "boom on purpose"),
])
def test_faults_end_the_job_with_one_clear_error(fault, words):
    r = launch("--backend", "jaccl", "-n", "3", str(SCRIPTS / "faults.py"), timeout=50, FAULT=fault)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert words in out, out[-3000:]
    assert "launcher: rank " in r.stderr, r.stderr[-2000:]  # the launcher names a failing rank


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", [
    "jaccl",
    "mpi",
    "ring",
])
def test_symmetric_exchange_of_large_messages_does_not_deadlock(backend):
    r = launch("--backend", backend, "-n", "2", str(SCRIPTS / "exchange.py"), timeout=50,
               JACKLRING_TIMEOUT="8", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_btl_tcp_if_include="lo", OMPI_MCA_btl="self,sm,tcp")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(line.split("] ", 1)[1] for line in r.stdout.splitlines() if "exchange ok" in line) == [
        "exchange ok 0", "exchange ok 1"]
