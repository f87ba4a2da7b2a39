"""adapter.init() under engines other than our launcher: torchrun, plain torch variables, an
existing torch process group, mpirun; and the Slurm helpers that need no Slurm."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import ranks
import zygote
from engine_harness import HERE, RANK_SCRIPT, ROOT, VENV_BIN, Lines, clean_env, describe, results, run, spawn_ranks

from adapter import engines
from adapter.bench import free_ports
from adapter.errors import ConfigError

TORCHRUN = os.path.join(VENV_BIN, "torchrun")
MPIRUN = os.path.join(VENV_BIN, "mpirun")


def torchrun(n: int, mode: str, **env: str) -> subprocess.CompletedProcess:
    return run([TORCHRUN, "--nproc-per-node", str(n), "--master-port", str(free_ports(1)[0]),
                RANK_SCRIPT, mode], clean_env(**env))


def plain_torch_env(n: int, **extra: str):
    """RANK/WORLD_SIZE/MASTER_* as Accelerate, Lightning or a hand-written script set them:
    no torchrun agent, so rank 0 serves the store."""
    port = str(free_ports(1)[0])
    return lambda r: clean_env(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                               MASTER_PORT=port, **extra)


@pytest.mark.timeout(60)
def test_torchrun_numpy_api_and_average_gradients():
    proc = torchrun(2, "grads")
    assert proc.returncode == 0, describe([proc])
    found = results(proc.stdout)
    assert [(r["rank"], r["size"], r["sum"]) for r in found] == [(0, 2, 1.0), (1, 2, 1.0)]
    assert [r["grads"] for r in found] == [[0.5] * 4] * 2  # mean of 0.0 and 1.0, not 0.0 and 1.0


@pytest.mark.timeout(90)
def test_torchrun_elastic_restart_forms_the_group_again():
    proc = run([TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "1", "--master-port", str(free_ports(1)[0]),
                RANK_SCRIPT, "elastic"], clean_env(), timeout=80)
    assert proc.returncode == 0, describe([proc])
    assert [(r["rank"], r["size"], r["sum"], r["attempt"]) for r in results(proc.stdout)] == \
        [(0, 2, 1.0, 1), (1, 2, 1.0, 1)], proc.stdout


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["elastic-early", "elastic-early-pg"])
def test_torchrun_restart_after_a_rank_died_before_joining(mode):
    """Rank 1 exits 1 in the first attempt before it joins while rank 0 already waits. The
    torchrun agent keeps its store over the restart; with a joins counter in it the ranks of
    the second attempt computed different generations and waited out the connect timeout
    ("ranks [1] did not publish"). Formations are tagged by the restart attempt now."""
    proc = run([TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_ports(1)[0]}", RANK_SCRIPT, mode],
               clean_env(JACKLRING_CONNECT_TIMEOUT="25"), timeout=80)
    assert proc.returncode == 0, describe([proc])
    assert [(r["rank"], r["size"], r["sum"], r["attempt"]) for r in results(proc.stdout)] == \
        [(0, 2, 1.0, 1), (1, 2, 1.0, 1)], proc.stdout
    _assert_quick_recovery(proc.stdout, "joining")


def _assert_quick_recovery(stdout: str, moment: str) -> None:
    """The restart costs its own time plus at most 5 s (torchrun's reaction to the death), and
    the new attempt's formation waits out no deadline (a fraction of the connect timeout). Both
    measured from the ranks' own clock stamps, so a loaded machine's slow imports do not count."""
    found = results(stdout)
    died = [float(line.split()[1]) for line in stdout.splitlines() if line.startswith("DIED ")]
    assert len(died) == 1 and f"at {moment}" in stdout, stdout
    restarted, done = min(r["t0"] for r in found), max(r["t1"] for r in found)
    recovery, own = done - died[0], done - restarted
    assert recovery <= own + 5, f"recovered {recovery:.1f} s after the death, the attempt itself took {own:.1f} s"
    assert max(r["forming_s"] for r in found) < 10, f"the new attempt waited out a deadline: {found}"


def _rendezvous_args(rdzv: str) -> list[str]:
    port = str(free_ports(1)[0])
    if rdzv == "c10d":
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    return ["--master-port", port]  # torchrun's default: the static rendezvous


@pytest.mark.timeout(150)
@pytest.mark.parametrize("rdzv, moment", [("c10d", "forming"), ("c10d", "formed"), ("static", "forming")])
def test_torchrun_restart_after_a_rank_died_while_or_after_forming(rdzv, moment):
    """Rank 1 dies (os._exit) in the first attempt inside init_process_group("jacklring"),
    once it has read every address and rank 0 is connecting to it ("forming"), or after the
    first all_reduce ("formed"). The restart must cost no more than its own time plus 5 s."""
    proc = run([TORCHRUN, "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2",
                *_rendezvous_args(rdzv), RANK_SCRIPT, "elastic-at"],
               clean_env(ENGINE_TEST_DIE_AT=moment, JACKLRING_CONNECT_TIMEOUT="20", JACKLRING_TIMEOUT="20"),
               timeout=140)
    assert proc.returncode == 0, describe([proc])
    found = results(proc.stdout)
    assert [(r["rank"], r["size"], r["sum"], r["attempt"]) for r in found] == \
        [(0, 2, 2.0, 1), (1, 2, 2.0, 1)], proc.stdout
    _assert_quick_recovery(proc.stdout, moment)


GROW_RANK = os.path.join(HERE, "torchrun_grow_rank.py")


@pytest.mark.timeout(120)
def test_torchrun_agent_store_takes_newcomers_at_slots_2_then_0():
    """docs/faults.md's torchrun recipe: under torchrun's agent (which serves the store), slot 2
    of 3 workers exits 0; the agent keeps the others running (no restart: one "started" line
    per slot), they shrink and grow, and a newcomer started outside torchrun with slot 2's
    torchrun variables and JACKLRING_JOIN=1 is taken in as rank 2. Then slot 0 exits 0 the
    same way: the agent's store outlives it, so its vacancy is not refused, and a newcomer with
    slot 0's variables is taken in (as rank 2: the members keep ranks 0 and 1). torchrun exits 0.

    The key goes through the store, as in a torchrun job over several nodes without a secret:
    before newcomers only read it, the one at slot 0 drew a key of its own over the members'
    (rank 0 draws it) and its knock record failed their MAC."""
    env = clean_env(ENGINE_TEST_LEAVERS="2,0", JACKLRING_CONNECT_TIMEOUT="30", JACKLRING_ALLOW_UNAUTHENTICATED="1")
    torchrun = subprocess.Popen([TORCHRUN, "--nproc-per-node", "3", "--max-restarts", "0", "--master-port",
                                 str(free_ports(1)[0]), GROW_RANK], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = Lines(torchrun.stdout), Lines(torchrun.stderr)
    newcomers: list = []
    try:
        # torchrun's workers that shrink after each leaver (slot 2's newcomer prints to its own pipe)
        for leaver, workers in ((2, 2), (0, 1)):
            found = out.wait_for(
                lambda rs: sum(r["stage"] == "shrunk" and r["leaver"] == leaver for r in rs) == workers,
                f"torchrun's workers to shrink after slot {leaver} left", 60)
            worker = next(r["env"] for r in found if r["stage"] == "started" and r["slot"] == leaver)
            # The worker's torchrun variables, less the error file its agent made for it alone.
            worker.pop("TORCHELASTIC_ERROR_FILE", None)
            newcomers.append(zygote.popen([sys.executable, GROW_RANK], env={**env, **worker, "JACKLRING_JOIN": "1"},
                                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        torchrun.wait(timeout=60)
        joined = ranks.collect(newcomers, timeout=30)
    except BaseException:
        os.killpg(torchrun.pid, signal.SIGKILL)  # torchrun and its workers (a session of their own)
        for p in newcomers:
            p.kill()
        raise
    members = out.finish(10)
    report = f"torchrun exit {torchrun.returncode}:\n{members}{err.finish(10)}\nnewcomers:\n{describe(joined)}"
    assert torchrun.returncode == 0 and all(p.returncode == 0 for p in joined), report
    lines = out.records() + [json.loads(line) for p in joined for line in p.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["slot"] for r in out.records() if r["stage"] == "started") == [0, 1, 2], report  # no restart
    assert sorted((r["leaver"], r["slot"], r["size"], r["failed"]) for r in lines if r["stage"] == "shrunk") == \
        [(0, 1, 2, "PeerError"), (0, 2, 2, "PeerError"), (2, 0, 2, "PeerError"), (2, 1, 2, "PeerError")], report
    grown = sorted((r["leaver"], r["rank"], r["slot"], r["size"], r["slots"], r["right"])
                   for r in lines if r["stage"] == "grown")
    assert grown == [(0, 0, 1, 3, [1, 2, 0], True), (0, 1, 2, 3, [1, 2, 0], True), (0, 2, 0, 3, [1, 2, 0], True),
                     (2, 0, 0, 3, [0, 1, 2], True), (2, 1, 1, 3, [0, 1, 2], True), (2, 2, 2, 3, [0, 1, 2], True)], \
        report


@pytest.mark.timeout(60)
def test_plain_torch_variables_three_ranks():
    procs = spawn_ranks(3, "numpy", plain_torch_env(3))
    assert all(p.returncode == 0 for p in procs), describe(procs)
    found = [r for p in procs for r in results(p.stdout)]
    assert [(r["rank"], r["size"], r["sum"]) for r in found] == [(0, 3, 3.0), (1, 3, 3.0), (2, 3, 3.0)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pg_backend", ["gloo", "jacklring"])
def test_existing_torch_group_carries_the_numpy_api(pg_backend):
    procs = spawn_ranks(2, "torch-first", plain_torch_env(2, ENGINE_TEST_PG_BACKEND=pg_backend))
    assert all(p.returncode == 0 for p in procs), describe(procs)
    found = [r for p in procs for r in results(p.stdout)]
    assert [(r["adapter_rank"], r["adapter_size"], r["sum"], r["torch_sum"]) for r in found] == \
        [(0, 2, 1.0, 1.0), (1, 2, 1.0, 1.0)]
    # No newcomer can join these rings: grow() says why at once, and each ring sums right after.
    why = {"numpy": "it was formed through the store of an existing torch process group, which cannot take in a "
                    "process that is not one of its ranks",
           "split": "it was formed by split()",
           "torch": "it is the ring of a torch process group (init_process_group), which cannot take in a process "
                    "that is not one of its ranks"}
    for r in found:
        refusals = r["refusals"]
        assert sorted(refusals) == sorted(why if pg_backend == "jacklring" else ("numpy", "split")), refusals
        for ring, (kind, text, after, seconds) in refusals.items():
            assert kind == "DistributedError" and f"rank {r['adapter_rank']}: grow: this group cannot take in " \
                "newcomers" in text and why[ring] in text, (ring, text)
            assert after == 2.0 and seconds < 1.0, (ring, after, seconds)


@pytest.mark.timeout(60)
def test_ddp_under_torchrun_beside_the_numpy_api():
    proc = torchrun(2, "ddp")
    assert proc.returncode == 0, describe([proc])
    found = results(proc.stdout)
    assert [(r["size"], r["replicas_equal"], r["sum"]) for r in found] == [(2, True, 1.0)] * 2


@pytest.mark.timeout(30)
def test_world_size_without_a_rendezvous_raises_instead_of_a_group_of_one():
    env = clean_env(RANK="0", WORLD_SIZE="2")
    start = time.monotonic()
    proc = run([sys.executable, RANK_SCRIPT, "numpy"], env)
    assert proc.returncode != 0 and "RESULT" not in proc.stdout
    assert "ConfigError" in proc.stderr and "RANK=0, WORLD_SIZE=2" in proc.stderr, proc.stderr
    assert "MASTER_ADDR, MASTER_PORT are not set" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 20


@pytest.mark.timeout(30)
def test_strict_names_every_engine():
    code = "import adapter; adapter.init(strict=True)"
    proc = run([sys.executable, "-c", code], clean_env())
    assert proc.returncode != 0
    for reason in ("ring: MLX_RANK and MLX_HOSTFILE not set", "torch-group: torch.distributed is not imported",
                   "torchrun: RANK and WORLD_SIZE not set", "slurm: SLURM_PROCID not set",
                   "mpi: not launched by mpirun"):
        assert reason in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.exists(MPIRUN), reason="no mpirun in the venv (pip install jacklring[mpi])")
def test_init_process_group_under_plain_mpirun():
    env = clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_tcp_if_include="lo")
    proc = run([MPIRUN, "-n", "2", "--oversubscribe", sys.executable, RANK_SCRIPT, "torch-pg"], env)
    assert proc.returncode == 0, describe([proc])
    assert [(r["rank"], r["size"], r["torch_sum"]) for r in results(proc.stdout)] == [(0, 2, 1.0), (1, 2, 1.0)]


def test_slurm_hostlist_expansion():
    assert engines.expand_hostlist("n[01-03,7],gpu1") == ["n01", "n02", "n03", "n7", "gpu1"]
    assert engines.expand_hostlist("a[1-2]-b[3-4]") == ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]
    assert engines.expand_hostlist("localhost") == ["localhost"]
    with pytest.raises(ConfigError):
        engines.expand_hostlist("n[x-3]")


def test_slurm_ports_differ_between_jobs_and_steps(monkeypatch):
    monkeypatch.delenv("JACKLRING_SLURM_PORT", raising=False)
    ports = {engines.slurm_rendezvous({"SLURM_STEP_NODELIST": "n[1-2]", "SLURM_JOB_ID": str(job),
                                       "SLURM_STEP_ID": str(step)})
             for job in range(100, 140) for step in range(4)}
    assert {host for host, _ in ports} == {"n1"} and len(ports) == 160
    assert all(engines.SLURM_PORT_BASE <= port < engines.SLURM_PORT_BASE + engines.SLURM_PORT_SPAN
               for _, port in ports)
    reserved = {"SLURM_STEP_NODELIST": "n1", "SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0",
                "SLURM_STEP_RESV_PORTS": "12000-12015"}
    assert engines.slurm_rendezvous(reserved) == ("n1", 12000)
    monkeypatch.setenv("JACKLRING_SLURM_PORT", "31000")
    assert engines.slurm_rendezvous(reserved) == ("n1", 31000)


@pytest.mark.timeout(90)
def test_slurm_steps_sharing_a_store_port_never_mix_their_ranks():
    """Two 2-task steps on one node with the same store port (a collision of derived ports, or
    JACKLRING_SLURM_PORT set alike). Job A's task 0 serves the store; job B's task 1 joins it
    before A's task 1 does. Before the keys were per step, B's task 1 took the second seat of
    A's group (a 2-rank "job" of A's task 0 and B's task 1, with the right size and sum) and
    A's task 1 waited for a group that never formed. Now A forms alone and B fails, naming
    the rendezvous."""
    port = str(free_ports(1)[0])

    def task(job: str, procid: int) -> subprocess.Popen:
        env = clean_env(SLURM_PROCID=str(procid), SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2",
                        SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_STEP_NODELIST="localhost",
                        SLURM_LOCALID=str(procid), JACKLRING_SLURM_PORT=port,
                        JACKLRING_CONNECT_TIMEOUT="20", OMP_NUM_THREADS="1")
        return zygote.popen([sys.executable, RANK_SCRIPT, "numpy"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)

    a0 = task("101", 0)
    b1 = b0 = None
    try:
        _wait_for(lambda: _listening(int(port)), "A's store to listen", [a0])
        b1, b0 = task("202", 1), task("202", 0)
        _wait_for(lambda: b0.poll() is not None, "B's task 0 to find the port taken and fail", [a0])
        _wait_for(lambda: _connected(b1.pid, int(port)), "B's task 1 to join A's store", [a0, b1])
    except BaseException:
        for p in (a0, b1, b0):
            if p is not None:
                p.kill()
                p.communicate()
        raise
    a1 = task("101", 1)
    done = ranks.collect([a0, a1, b0, b1], timeout=60)
    report = describe(done)
    assert done[0].returncode == 0 and done[1].returncode == 0, report
    assert [(r["rank"], r["size"], r["sum"]) for r in results(done[0].stdout + done[1].stdout)] == \
        [(0, 2, 1.0), (1, 2, 1.0)], report
    assert done[2].returncode != 0 and done[3].returncode != 0, report
    assert f"Slurm rendezvous at localhost:{port}" in done[2].stderr, report
    # B's task 1 waited in A's store, for its own keys only, until A ended and took the store along
    assert "rank 1: jacklring rendezvous" in done[3].stderr and "Slurm store" in done[3].stderr, report


def _tcp_table() -> list[list[str]]:
    rows = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                rows += [line.split() for line in f.readlines()[1:]]
        except FileNotFoundError:
            pass
    return rows


def _listening(port: int) -> bool:
    """Whether a socket of this host listens on port (state 0A in /proc/net/tcp)."""
    return any(row[1].endswith(f":{port:04X}") and row[3] == "0A" for row in _tcp_table())


def _connected(pid: int, port: int) -> bool:
    """Whether process pid holds an established connection to port on this host."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:  # the process ended (or an fd closed meanwhile)
        return False
    return any(row[2].endswith(f":{port:04X}") and row[3] == "01" and row[9] in inodes for row in _tcp_table())


def _wait_for(condition, what: str, alive: list[subprocess.Popen], timeout_s: float = 20) -> None:
    """Poll condition until true; fails when it is not by the timeout or a process of alive ended."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        ended = [p.args for p in alive if p.poll() is not None]
        assert not ended, f"while waiting for {what}: {ended} ended"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


def test_mpi_world_agreeing_with_torch_variables_defers_to_mpi():
    env = {"RANK": "1", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    assert "mpi backend forms it" in engines._probe_torchrun(env)
    # torchrun started by mpirun, one per node: torchrun's world wins
    env.update(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="1", RANK="1", WORLD_SIZE="4")
    assert engines._probe_torchrun(env) is None


