"""Under a real Slurm (tests/engines/slurm_cluster.py): srun with no wrapper script, and the
job script of docs/launching.md exactly as written there."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_harness import RANK_SCRIPT, ROOT, VENV_BIN, clean_env, describe, results
from slurm_cluster import SlurmCluster, missing

DOC = Path(ROOT, "docs", "launching.md")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node Slurm; skipped with the reason when Slurm cannot run here."""
    reason = missing()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def slurm_env(cluster, **extra: str) -> dict[str, str]:
    # The venv first on PATH: the documented recipe says `python`.
    return clean_env(PATH=f"{VENV_BIN}:{os.environ['PATH']}", **cluster.env, **extra)


@pytest.mark.timeout(90)
def test_srun_three_tasks_numpy_api_average_gradients_and_ddp(slurm):
    proc = subprocess.run(["srun", "-n", "3", "--overcommit", sys.executable, RANK_SCRIPT, "all"],
                          env=slurm_env(slurm), cwd=ROOT, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, describe([proc]) + slurm.logs()
    found = results(proc.stdout)
    assert [(r["rank"], r["size"], r["sum"], r["grads"]) for r in found] == \
        [(r, 3, 3.0, [1.0]) for r in range(3)], proc.stdout
    assert [(r["torch_rank"], r["torch_size"], r["replicas_equal"]) for r in found] == \
        [(r, 3, True) for r in range(3)]


def pmix_missing(cluster) -> str | None:
    listed = subprocess.run(["srun", "--mpi=list"], env=slurm_env(cluster), capture_output=True, text=True,
                            timeout=20)
    if "pmix" not in listed.stdout + listed.stderr:
        return "Slurm's PMIx plugin is not usable (apt-get install libpmix-dev)"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install jacklring[mpi])"
    return None


@pytest.mark.timeout(60)
def test_srun_mpi_pmix_uses_mpi(slurm):
    reason = pmix_missing(slurm)
    if reason:
        pytest.skip(reason)
    env = slurm_env(slurm, OMPI_MCA_btl_tcp_if_include="lo")
    proc = subprocess.run(["srun", "--mpi=pmix", "-n", "2", sys.executable, RANK_SCRIPT, "numpy"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, describe([proc]) + slurm.logs()
    # the MPI world, not a Slurm store ring (Slurm's variables give way to MPI's)
    assert [(r["rank"], r["size"], r["sum"], r["backend"]) for r in results(proc.stdout)] == \
        [(0, 2, 1.0, "mpi"), (1, 2, 1.0, "mpi")]


def wait_for_job(job_id: str, env: dict[str, str], deadline_s: float) -> str:
    """The job's final state. Polled here: `sbatch --wait` polls at seconds-long intervals."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True,
                             text=True, timeout=10).stdout
        state = re.search(r"JobState=(\S+)", out)
        if state and state.group(1) not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return state.group(1)
        time.sleep(0.2)
    subprocess.run(["scancel", job_id], env=env, timeout=10)
    raise AssertionError(f"job {job_id} did not end within {deadline_s} s")


def documented_job_script() -> str:
    """The Slurm job script in docs/launching.md (the block after the 'tested-slurm-job' marker)."""
    text = DOC.read_text()
    match = re.search(r"<!-- tested-slurm-job -->\s*```(?:sh|bash)\n(.*?)```", text, re.S)
    assert match, "docs/launching.md has no Slurm job script after <!-- tested-slurm-job -->"
    return match.group(1)


TRAIN = '''
# torch's group first (fill_torch_env() sets RANK/WORLD_SIZE/MASTER_* from Slurm's variables),
# then the numpy API over it: the other order from test_srun_three_tasks_...
import sys, torch, torch.distributed as dist, adapter, adapter.torch_backend
adapter.torch_backend.fill_torch_env()
dist.init_process_group("jacklring")
model = torch.nn.Linear(3, 1)
for p in model.parameters():
    p.grad = torch.full_like(p, float(dist.get_rank()))
adapter.average_gradients(model)
world = adapter.init()
line = {"rank": world.rank(), "size": world.size(), "torch_size": dist.get_world_size(),
        "grad": float(model.bias.grad[0])}
sys.stdout.write(f"RESULT {line}\\n")  # one write: the tasks share the output file
sys.stdout.flush()
'''


@pytest.mark.timeout(90)
def test_documented_job_script_under_sbatch(slurm, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(documented_job_script())
    (tmp_path / "train.py").write_text(TRAIN)
    env = slurm_env(slurm)
    proc = subprocess.run(["sbatch", "--parsable", str(script)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=20)
    assert proc.returncode == 0, f"{describe([proc])}\n{slurm.logs()}"
    state = wait_for_job(proc.stdout.strip().split(";")[0], env, deadline_s=80)
    outputs = {p.name: p.read_text() for p in tmp_path.glob("*.out")}
    assert state == "COMPLETED", f"job ended {state}\n{outputs}\n{slurm.logs()}"
    text = "".join(outputs.values())
    lines = sorted(line for line in text.splitlines() if line.startswith("RESULT"))
    assert lines == [f"RESULT {{'rank': {r}, 'size': 3, 'torch_size': 3, 'grad': 1.0}}" for r in range(3)], text


GROW_RANK = os.path.join(ROOT, "tests", "engines", "slurm_grow_rank.py")
STEP_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_TASKS")


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.timeout(90)
def test_a_newcomer_in_a_second_step_joins_through_the_first_steps_store(slurm):
    """docs/faults.md's Slurm recipe: slot 2 of a 3-task step leaves, the other two shrink and
    grow; a newcomer started by a second srun in the same job, with the first step's variables
    and SLURM_PROCID=2, is taken in as rank 2 through the first step's store."""
    env = slurm_env(slurm, JACKLRING_CONNECT_TIMEOUT="30")
    members = subprocess.Popen(["srun", "-n", "3", "--overcommit", sys.executable, GROW_RANK], env=env, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    newcomer = None
    try:
        shrunk, seen = [], []
        deadline = time.monotonic() + 40
        while len(shrunk) < 2 and time.monotonic() < deadline:
            line = members.stdout.readline()
            if not line:
                break
            seen.append(line)
            shrunk += [r for r in json_lines(line) if r["stage"] == "shrunk"]
        assert len(shrunk) == 2, "".join(seen) + slurm.logs()
        step = shrunk[0]["step"]
        overrides = [f"{k}={step[k]}" for k in STEP_VARIABLES] + ["SLURM_PROCID=2", "JACKLRING_JOIN=1"]
        newcomer = subprocess.run(
            ["srun", f"--jobid={step['SLURM_JOB_ID']}", "--overlap", "-n", "1", "--overcommit",
             "env", *overrides, sys.executable, GROW_RANK], env=env, cwd=ROOT, capture_output=True, text=True,
            timeout=45)
        rest, errors = members.communicate(timeout=30)
    finally:
        if members.poll() is None:
            members.kill()
            members.communicate()
    joined = json_lines(newcomer.stdout)
    grown = sorted((r for r in json_lines("".join(seen) + rest) + joined if r["stage"] == "grown"),
                   key=lambda r: r["rank"])
    report = f"members:\n{''.join(seen)}{rest}{errors}\nnewcomer:\n{describe([newcomer])}"
    assert newcomer.returncode == 0, report + slurm.logs()
    assert all(r["failed"] == "PeerError" and r["size"] == 2 for r in shrunk), report
    assert [(r["rank"], r["slot"], r["size"], r["slots"], r["right"]) for r in grown] == \
        [(0, 0, 3, [0, 1, 2], True), (1, 1, 3, [0, 1, 2], True), (2, 2, 3, [0, 1, 2], True)], report
