"""Installing jacklring must not change other programs: `import torch` loads its
"torch.backends" entry point in every program of the environment (gloo's too), and that must
register "jacklring" and nothing else: the same environment, threads (Python's and the process's
own) and sockets as with the entry point switched off (TORCH_DEVICE_BACKEND_AUTOLOAD=0: torch
then loads no plugin, as if jacklring were not installed), under mpirun and under torchrun; and
`import torch` itself opens no socket and starts no Python thread."""
from __future__ import annotations

import importlib.metadata
import os
import sys

import pytest
from engine_harness import HERE, VENV_BIN, clean_env, describe, results, run

from adapter.bench import free_ports

SCRIPT = os.path.join(HERE, "import_side_effects.py")
MPIRUN = os.path.join(VENV_BIN, "mpirun")
TORCHRUN = os.path.join(VENV_BIN, "torchrun")
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_btl_tcp_if_include": "lo"}

pytestmark = pytest.mark.skipif(
    not any(e.name == "jacklring" for e in importlib.metadata.entry_points(group="torch.backends")),
    reason="jacklring's torch.backends entry point is not installed (pip install -e .)")


def side_effects(cmd: list[str], autoload: str) -> list[dict]:
    proc = run(cmd, clean_env(TORCH_DEVICE_BACKEND_AUTOLOAD=autoload, **MPI_ENV), timeout=50)
    assert proc.returncode == 0, describe([proc])
    found = results(proc.stdout)
    assert [(r["rank"], r["sum"]) for r in found] == [(0, 1.0), (1, 1.0)], describe([proc])
    return found


def assert_import_changes_nothing(cmd: list[str]) -> None:
    with_plugin, without = side_effects(cmd, "1"), side_effects(cmd, "0")
    assert all("jacklring" in r["backends"] for r in with_plugin)  # the entry point did run
    assert all("jacklring" not in r["backends"] for r in without)
    for ours, theirs in zip(with_plugin, without):
        for what in ("env_added", "env_changed", "env_removed", "threads_added", "native_threads_added",
                     "sockets_added"):
            assert ours[what] == theirs[what], (what, ours, theirs)
        assert ours["env_added"] == {} and ours["env_changed"] == {}, ours
        assert ours["threads_added"] == [] and ours["sockets_added"] == 0, ours


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.exists(MPIRUN), reason="no mpirun in the venv (pip install jacklring[mpi])")
def test_import_torch_under_mpirun_changes_no_environment_or_threads():
    init_method = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    assert_import_changes_nothing([MPIRUN, "-n", "2", "--oversubscribe", sys.executable, SCRIPT, init_method])


@pytest.mark.timeout(120)
def test_import_torch_under_torchrun_changes_no_environment_or_threads():
    cmd = [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_ports(1)[0]), SCRIPT, "env://"]
    assert_import_changes_nothing(cmd)


LOADED_BY_IMPORT_TORCH = """
import sys
import torch
import torch.distributed as dist
print("JACKLRING" in dist.Backend._plugins)
print(" ".join(sorted(m for m in sys.modules if m.split(".")[0] in ("adapter", "jacklring_shared"))))
"""


@pytest.mark.timeout(60)
def test_import_torch_loads_only_the_plugin_not_the_backends():
    """Every program of the environment pays for the plugin at `import torch`: it registers
    "jacklring" and loads two modules, not the backends (those load when a group forms)."""
    proc = run([sys.executable, "-c", LOADED_BY_IMPORT_TORCH], clean_env(), timeout=50)
    assert proc.returncode == 0, describe([proc])
    registered, modules = proc.stdout.strip().splitlines()
    assert registered == "True", proc.stdout
    assert modules.split() == ["adapter", "adapter.torch_backend"], modules
