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
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed")
@pytest.mark.skipif(not os.path.exists(os.path.join(VENV_BIN, "mpirun")), reason="no mpirun in the venv")
def test_accelerate_launch_starts_cpu_ranks_only_through_mpirun(tmp_path):
    """`accelerate launch --cpu --num_processes 2` runs the script once (Accelerate's simple
    launcher); N CPU processes need --mpirun_hostfile, where Accelerate runs mpirun itself."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    env = clean_env(HF_HOME=str(tmp_path / "hf"), PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""),
                    OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_tcp_if_include="lo")
    accelerate = [os.path.join(VENV_BIN, "accelerate"), "launch", "--cpu", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                  "--main_process_port", str(free_ports(1)[0])]
    script = os.path.join(SCRIPTS, "accelerate_train.py")
    proc = run(accelerate + ["--mpirun_hostfile", str(hosts), script], env, timeout=110)
    assert proc.returncode == 0, describe([proc])
    assert [(r["rank"], r["size"], r["backend"], r["replicas_equal"], r["adapter_size"])
            for r in results(proc.stdout)] == [(0, 2, "jacklring", True, 2), (1, 2, "jacklring", True, 2)]
    alone = run(accelerate + [script], env, timeout=60)  # what the old recipe ran: one process
    assert alone.returncode != 0 and "RANK expected, but not set" in alone.stderr, describe([alone])


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
