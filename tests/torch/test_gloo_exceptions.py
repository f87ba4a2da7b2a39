"""Errors a gloo user's code expects: jacklring's refusals of an op/dtype combination and of
PREMUL_SUM are RuntimeErrors as gloo's are (and still the ValueErrors jacklring raised), and
`init_process_group("cpu:jacklring,cuda:nccl")` on a torch without NCCL says so, as gloo's
pairing does, instead of being accepted silently."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from ranks import free_ports

SCRIPTS = Path(__file__).parent / "scripts"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=80, env=env)


@pytest.mark.timeout(200)
def test_refused_reduce_ops_are_runtime_errors_as_on_gloo():
    cases = {}
    for backend in ("gloo", "jacklring"):
        r = _run(str(SCRIPTS / "gloo_exceptions.py"), backend, str(free_ports(1)[0]))
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
        for line in r.stdout.splitlines():
            if line.startswith("CASE "):
                _, name, _, *kinds = line.split()
                cases.setdefault(name, {})[backend] = kinds
    assert set(cases) == {"band-float", "bxor-float-async", "premul-sum"}, cases
    for name, by_backend in cases.items():
        assert by_backend["gloo"][0] == "True", (name, by_backend)           # what gloo users catch
        assert by_backend["jacklring"][:2] == ["True", "True"], (name, by_backend)  # RuntimeError, ValueError


@pytest.mark.timeout(200)
def test_a_pairing_with_nccl_on_a_torch_without_it_says_so():
    backend = "cpu:jacklring,cuda:nccl"  # "cpu:gloo,cuda:nccl" raises the same words there
    code = ("import os, torch.distributed as dist, adapter.torch_backend\n"
            f"os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='{free_ports(1)[0]}', RANK='0', WORLD_SIZE='1')\n"
            "try:\n"
            f"    dist.init_process_group({backend!r})\n"
            "    print('ACCEPTED')\n"
            "except RuntimeError as e:\n"
            "    print('REFUSED', e)\n")
    r = _run("-c", code)
    assert r.returncode == 0, r.stderr[-3000:]
    if dist.is_nccl_available():
        assert "ACCEPTED" in r.stdout, r.stdout
        assert "nccl is not used" in r.stderr, r.stderr  # jacklring serves cuda: nccl is never built
    else:
        assert r.stdout.startswith("REFUSED") and "doesn't have NCCL built in" in r.stdout, r.stdout
