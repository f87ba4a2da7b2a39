"""The Accelerate and Lightning Fabric recipes of docs/launching.md, run for real."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
from engine_harness import HERE, VENV_BIN, clean_env, describe, results, run

from adapter.bench import free_ports

SCRIPTS = os.path.join(HERE, "frameworks")


@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed")
def test_accelerate_recipe_under_torchrun():
    proc = run([os.path.join(VENV_BIN, "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_ports(1)[0]),
                os.path.join(SCRIPTS, "accelerate_train.py")], clean_env(), timeout=110)
    assert proc.returncode == 0, describe([proc])
    assert [(r["size"], r["backend"], r["replicas_equal"], r["adapter_size"]) for r in results(proc.stdout)] == \
        [(2, "jacklring", True, 2)] * 2


@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed")
def test_lightning_fabric_recipe():
    proc = run([sys.executable, os.path.join(SCRIPTS, "fabric_train.py")], clean_env(), timeout=110)
    assert proc.returncode == 0, describe([proc])
    found = results(proc.stdout)
    assert [(r["rank"], r["size"], r["backend"], r["replicas_equal"], r["adapter_size"], r["averaged"])
            for r in found] == [(0, 2, "jacklring", True, 2, 0.5), (1, 2, "jacklring", True, 2, 0.5)]


@pytest.mark.timeout(180)
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed")
def test_lightning_trainer_recipe():
    """The Trainer fits 3 steps on 2 processes, started by Lightning itself (a store ring) and by
    `launcher -n 2` (the launcher's ring): both ranks end with the parameters of the same 3 steps
    in one process on the union of their batches."""
    script = os.path.join(SCRIPTS, "trainer_train.py")
    for how, cmd, formed in (("lightning", [sys.executable, script], "store"),
                             ("launcher", [os.path.join(VENV_BIN, "launcher"), "-n", "2", script], "environment")):
        proc = run(cmd, clean_env(), timeout=80)
        assert proc.returncode == 0, f"started by {how}:\n" + describe([proc])
        found = results(proc.stdout)
        assert [(r["rank"], r["size"], r["backend"], r["steps"], r["formed"]) for r in found] == \
            [(0, 2, "jacklring", 3, formed), (1, 2, "jacklring", 3, formed)], f"started by {how}:\n" + describe([proc])
        assert found[0]["params"] == found[1]["params"], how
        assert found[0]["params"] == pytest.approx(found[0]["single_process"], rel=1e-5, abs=1e-6), how
        assert found[0]["params"] != pytest.approx(fresh_parameters(), abs=1e-3), how  # it trained


def fresh_parameters() -> list[float]:
    import torch

    torch.manual_seed(1)
    return torch.cat([p.detach().flatten() for p in torch.nn.Linear(3, 1).parameters()]).tolist()
