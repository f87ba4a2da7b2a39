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
