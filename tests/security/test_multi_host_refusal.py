"""A store ring whose engine says it spans hosts, started without a job secret, is refused
(docs/security.md, torchrun): its listeners and torch's unauthenticated store face the
network, so a key handed over through the store would let in anyone who reaches MASTER_PORT.
Before, such a group only logged a warning, and with a loopback MASTER_ADDR it even took a
single-host file secret. Two real ranks through adapter.init, torchrun's variables of two
nodes (one rank each), everything on 127.0.0.1."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed")

import zygote  # noqa: E402

from adapter.bench import free_ports  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RANK_SCRIPT = ROOT / "tests" / "engines" / "engine_rank.py"


def two_node_env(rank: int, port: int, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JACKLRING_", "MLX_", "SLURM_", "TORCHELASTIC_", "OMPI_", "PMI"))}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", XDG_RUNTIME_DIR=str(tmp_path),
               RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               GROUP_RANK=str(rank), GROUP_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="two-nodes",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               JACKLRING_CONNECT_TIMEOUT="20", JACKLRING_TIMEOUT="20", **extra)
    return env


def run_pair(tmp_path: Path, **extra: str) -> list[tuple[int, str, str]]:
    port = free_ports(1)[0]
    procs = [zygote.popen([sys.executable, str(RANK_SCRIPT), "numpy"], cwd=ROOT,
                          env=two_node_env(q, port, tmp_path, **extra),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for q in range(2)]
    outcomes = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        outcomes.append((p.returncode, out, err))
    return outcomes


@pytest.mark.timeout(90)
def test_two_nodes_without_a_secret_are_refused_saying_how_to_set_one(tmp_path):
    outcomes = run_pair(tmp_path)
    for code, out, err in outcomes:
        assert code != 0 and "RESULT" not in out, f"exit {code}\n{out}\n{err}"
        assert "ConfigError" in err and "spans hosts" in err, err  # at once, not a rendezvous timeout
        assert "JACKLRING_SECRET" in err and "JACKLRING_SECRET_FILE" in err, err
        assert "JACKLRING_ALLOW_UNAUTHENTICATED=1" in err, err
    assert not (tmp_path / f"jacklring-{os.getuid()}").exists()  # no single-host secret was derived


@pytest.mark.timeout(90)
@pytest.mark.parametrize("setting", ["secret", "opt-out"])
def test_two_nodes_form_with_a_secret_or_the_opt_out(tmp_path, setting):
    extra = {"JACKLRING_SECRET": "ab" * 32} if setting == "secret" else {"JACKLRING_ALLOW_UNAUTHENTICATED": "1"}
    for code, out, err in run_pair(tmp_path, **extra):
        assert code == 0 and '"sum": 1.0' in out, f"exit {code}\n{out}\n{err}"
