"""Two processes sharing one GPU: the ring backend with cupy buffers (staged through pinned
host memory) and a CUDA DDP step on the jacklring torch process group. With two or more
GPUs, also NCCL between two processes."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from gpu_common import needs_gpu, needs_two_gpus, require_cupy
from ranks import ROOT, assert_all_ok, collect, free_ports, run

pytestmark = [needs_gpu]
SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
ENV = {"JACKLRING_CONNECT_TIMEOUT": "60", "JACKLRING_TIMEOUT": "60", "CUDA_VISIBLE_DEVICES": "0"}


@pytest.mark.timeout(150)
def test_ring_with_cupy_buffers_on_one_gpu():
    require_cupy()
    results = run(2, os.path.join(SCRIPTS, "ring_cupy_rank.py"), timeout=120, env=ENV)
    assert_all_ok(results)
    assert all("ring with cupy buffers OK" in r.stdout for r in results)


@pytest.mark.timeout(150)
def test_cuda_ddp_step_on_jacklring():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.fail(f"torch {torch.__version__} in this environment has no CUDA: the DDP check needs a CUDA "
                    f"build (scripts/gpu_check.sh installs one unless GPU_CHECK_NO_INSTALL=1)")
    port = free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "MASTER_"))}
    env.update(ENV, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "ddp_cuda_rank.py"), str(r), "2", str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    results = collect(procs, timeout=120)
    assert_all_ok(results)
    assert all("CUDA DDP step on jacklring OK" in r.stdout for r in results)


@needs_two_gpus
@pytest.mark.timeout(150)
def test_nccl_between_two_processes():
    require_cupy()
    port = free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    env.update(PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", MLX_WORLD_SIZE="2", NCCL_HOST_IP="127.0.0.1",
               NCCL_PORT=str(port), JACKLRING_CONNECT_TIMEOUT="60", JACKLRING_TIMEOUT="60")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    procs = [subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "nccl_rank.py")], env=dict(env, MLX_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    results = collect(procs, timeout=120)
    assert_all_ok(results)
    assert all("nccl OK" in r.stdout for r in results)
