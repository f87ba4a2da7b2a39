"""The torch.distributed backend "jacklring" in real processes over loopback sockets.

Every multi-rank check runs in worker scripts (tests/torch/workers/) spawned with torch's
own rendezvous, under torchrun, or under our launcher; each worker prints ALL OK or raises.
"""
from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch_harness as harness

pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import adapter.torch_backend  # noqa: E402

TORCHRUN = os.path.join(harness.VENV_BIN, "torchrun")
LAUNCHER = os.path.join(harness.VENV_BIN, "launcher")


def test_registration_is_idempotent_and_declares_devices():
    assert adapter.torch_backend.register_backend()
    assert adapter.torch_backend.register_backend()
    assert "jacklring" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["jacklring"] == ["cpu", "cuda"]
    assert dist.Backend.JACKLRING == "jacklring"


def test_pg_options_choose_the_backend_and_reject_nonsense():
    from adapter.errors import ConfigError
    from adapter.torch_backend.rendezvous import JacklringOptions, backend_choice
    assert backend_choice(JacklringOptions(backend="ring")) == "ring"
    assert backend_choice({"backend": "MPI"}) == "mpi"
    assert backend_choice("any") == "any"
    with pytest.raises(ConfigError, match="choose one of"):
        backend_choice("carrier-pigeon")


@pytest.mark.timeout(90)
def test_what_a_demanding_user_runs_matches_gloo_on_four_ranks():
    """Subgroups (a subset, non-members, new_subgroups, a 2x2 mesh), uneven all_to_all, non-zero
    roots on non-contiguous tensors, object collectives, dtype x op, empty tensors, tags in
    reverse order, Work.wait(timeout), two groups driven from two threads."""
    harness.assert_all_ok(harness.run(4, "adversarial.py", timeout=80))


@pytest.mark.timeout(60)
def test_exit_collects_cyclic_garbage_before_interpreter_finalization():
    results = harness.run(1, "exit_gc.py", timeout=50)
    harness.assert_all_ok(results, marker="exit_gc ALL OK")
    assert "cycle freed while finalizing: False" in results[0].stdout, results[0].report()


@pytest.mark.timeout(60)
def test_dead_peer_raises_within_seconds():
    results = harness.run(2, "failures.py", "kill", timeout=50)
    assert results[1].returncode == -9, results[1].report()
    match = re.search(r"RAISED ([0-9.]+) (\w+): (.*)", results[0].stdout)
    assert results[0].returncode == 0 and match, results[0].report()
    assert float(match.group(1)) < 10, match.group(0)
    assert "rank 1" in match.group(3) and "then:" in results[0].stdout


@pytest.mark.timeout(60)
def test_per_operation_timeout_raises():
    results = harness.run(2, "failures.py", "timeout", timeout=50)
    match = re.search(r"RAISED ([0-9.]+) (\w+): (.*)", results[0].stdout)
    assert results[0].returncode == 0 and match, results[0].report()
    assert 1.5 < float(match.group(1)) < 5, match.group(0)
    assert match.group(2) == "CollectiveTimeout"


def _run_command(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, cwd=harness.ROOT, env=harness.clean_env(), capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{command[0]} did not finish in {timeout} s:\n{exc.stdout}\n{exc.stderr}")


@pytest.mark.timeout(90)
def test_torchrun_env_rendezvous_ddp_matches_gloo():
    port = harness.free_port()
    done = _run_command([TORCHRUN, "--nproc-per-node", "2", "--master-port", str(port),
                         os.path.join(harness.WORKERS, "training.py"), "ddp", "no_sync"], timeout=80)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert done.stdout.count("training ALL OK") == 2, done.stdout


@pytest.mark.timeout(90)
@pytest.mark.skipif(not os.path.exists(LAUNCHER), reason="the launcher entry point is not installed in this venv")
def test_launcher_uses_the_mlx_ring_and_ddp_matches_gloo():
    done = _run_command([LAUNCHER, "-n", "2", os.path.join(harness.WORKERS, "training.py"), "ddp", "zero",
                         "--expect-ring-from-hostfile"], timeout=80)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert done.stdout.count("training ALL OK") == 2, done.stdout
    assert done.stdout.count("underlying backend: ring (MLX_HOSTFILE)") == 2, done.stdout
