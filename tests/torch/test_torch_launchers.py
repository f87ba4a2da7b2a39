"""torch scripts under the real `mlx.launch` (the mlx package's launcher): the ring and JACCL
backends; and under our `launcher --backend jaccl`, whose torch group runs on JACCL too.
mlx.launch sets only the MLX variables; adapter.torch_backend.fill_torch_env() derives
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from them, and the default group runs on the
backend mlx.launch started (its description says which)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ranks import free_ports

MLX_LAUNCH = Path(sys.executable).with_name("mlx.launch")
SCRIPT = Path(__file__).parent / "scripts" / "mlx_launched.py"
LAUNCHER = Path(sys.executable).with_name("launcher")
NO_MLX = pytest.mark.skipif(not MLX_LAUNCH.exists(), reason=f"{MLX_LAUNCH} is missing (pip install mlx)")


def _run(args: list[str], tmp_path: Path) -> list[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", JACKLRING_SECRET="9f2c4be1a7d05e63c8b1f0a4d2e97c15")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    r = subprocess.run([str(MLX_LAUNCH), *args, "--", sys.executable, str(SCRIPT)], capture_output=True,
                       text=True, timeout=130, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout.splitlines()


def _check(lines: list[str], backend: str) -> None:
    results = sorted(line for line in lines if line.startswith("RESULT"))
    wanted = ["MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"]
    assert results == [f"RESULT {r} 2 {[3.0] * 4} {wanted}" for r in range(2)], lines
    descriptions = [line for line in lines if line.startswith("DESC")]
    assert len(descriptions) == 2 and all(f"over the {backend} backend (from the environment)" in d
                                          for d in descriptions), descriptions


@NO_MLX
@pytest.mark.timeout(150)
def test_init_process_group_under_mlx_launch_ring(tmp_path):
    port = free_ports(1)[0]
    _check(_run(["--backend", "ring", "-n", "2", "--starting-port", str(port)], tmp_path), "ring")


@NO_MLX
@pytest.mark.timeout(150)
def test_init_process_group_under_mlx_launch_jaccl(tmp_path):
    # mlx.launch refuses a JACCL hostfile without an RDMA device per pair; the names are not
    # real devices, so the ranks run JACCL's TCP mesh (JACKLRING_JACCL_TRANSPORT=tcp).
    hosts = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"], "rdma": [None, "rdma_fake0"]},
             {"ssh": "127.0.0.1", "ips": ["127.0.0.1"], "rdma": ["rdma_fake1", None]}]
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(hosts))
    port = free_ports(1)[0]
    lines = _run(["--backend", "jaccl", "--hostfile", str(hostfile), "--starting-port", str(port),
                  "--env", "JACKLRING_JACCL_TRANSPORT=tcp"], tmp_path)
    _check(lines, "jaccl")


@pytest.mark.timeout(150)
def test_launcher_backend_jaccl_puts_the_torch_group_on_jaccl(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("JACKLRING_TORCH_BACKEND", None)
    r = subprocess.run([str(LAUNCHER), "--backend", "jaccl", "-n", "2", str(SCRIPT)], capture_output=True,
                       text=True, timeout=130, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    body = [line.split("] ", 1)[1] for line in r.stdout.splitlines() if "] " in line]
    # the launcher set torch's variables itself: fill_torch_env() had nothing to add
    assert sorted(line for line in body if line.startswith("RESULT")) == \
        [f"RESULT {r} 2 {[3.0] * 4} []" for r in range(2)], r.stdout
    descriptions = [line for line in body if line.startswith("DESC")]
    assert len(descriptions) == 2 and all("over the jaccl backend (from the environment)" in d
                                          for d in descriptions), descriptions
