"""Errors, never hangs: dead peers, mismatches, bad configuration, deadlines, stray connections."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest
from ranks import ROOT, collect, free_ports, ring_hostfile, run, spawn

EXEC = "ring_scripts/exec.py"


def program(body: str) -> str:
    return "import os, sys, time, numpy as np, adapter\ng = adapter.init(strict=True)\nr = g.rank()\n" + body


@pytest.mark.timeout(60)
def test_peer_killed_mid_all_sum_raises_within_seconds():
    body = ("x = np.ones(32 * 1024 * 1024, np.float32)\n"
            "adapter.all_sum(x)\n"
            "if r == 1:\n"
            "    os._exit(9)  # dies abruptly, as kill -9 would, between collectives\n"
            "t = time.monotonic()\n"
            "try:\n"
            "    for _ in range(5): adapter.all_sum(x)\n"
            "except adapter.PeerError as e:\n"
            "    print('PEER', round(time.monotonic() - t, 2), e)\n"
            "    sys.exit(3)\n")
    res = run(3, EXEC, [program(body)], timeout=50)
    assert res[1].returncode == 9
    for survivor in (res[0], res[2]):
        assert survivor.returncode == 3, survivor.stderr
        assert "PEER" in survivor.stdout
        elapsed = float(survivor.stdout.split()[1])
        assert elapsed < 5, survivor.stdout
    # the neighbours name the dead rank (rank 0 may only see rank 2 give up)
    assert "rank 1" in res[0].stdout + res[2].stdout


pytest.mark.timeout(60)
@pytest.mark.parametrize("case,expected", [
    ("op", "all_reduce(max"),
    ("size", "bytes"),
    ("dtype", "float64"),
])
def test_mismatched_collectives_raise_on_both_sides(case, expected):
    body = ("n = {'size': 10 + r * 100000, 'op': 10, 'dtype': 10}[CASE]\n"
            "x = np.ones(n, np.float64 if (CASE == 'dtype' and r == 1) else np.float32)\n"
            "try:\n"
            "    if CASE == 'op' and r == 1: adapter.all_max(x)\n"
            "    else: adapter.all_sum(x)\n"
            "except (adapter.MismatchError, adapter.PeerError) as e:\n"
            "    print(type(e).__name__, e)\n"
            "    sys.exit(3)\n").replace("CASE", repr(case))
    res = run(2, EXEC, [program(body)], timeout=50)
    for r in res:
        assert r.returncode == 3, r.stdout + r.stderr
        assert "MismatchError" in r.stdout, r.stdout
        assert expected in r.stdout
        assert "rank 0" in r.stdout and "rank 1" in r.stdout


@pytest.mark.timeout(60)
def test_operation_deadline():
    # Rank 1 is 4 s late, or late until rank 0 has raised (a file beside the hostfile says so).
    body = ("raised = os.environ['MLX_HOSTFILE'] + '.raised'\n"
            "until = time.monotonic() + 4\n"
            "while r == 1 and not os.path.exists(raised) and time.monotonic() < until:\n"
            "    time.sleep(0.05)\n"
            "t = time.monotonic()\n"
            "try:\n"
            "    adapter.all_sum(np.ones(10))\n"
            "except adapter.CollectiveTimeout as e:\n"
            "    print('TIMEOUT', round(time.monotonic() - t, 1), e)\n"
            "    open(raised, 'w').close()\n"
            "    sys.exit(3)\n")
    res = run(2, EXEC, [program(body)], env={"JACKLRING_TIMEOUT": "1"}, timeout=50)
    assert res[0].returncode == 3 and "TIMEOUT" in res[0].stdout
    assert "rank 1" in res[0].stdout
    assert float(res[0].stdout.split()[1]) < 3


@pytest.mark.timeout(60)
def test_stalled_rank_that_resumes_completes():
    body = ("print('ready', flush=True)\n"
            "time.sleep(0.5)\n"
            "y = adapter.all_sum(np.full(1000, r + 1.0))\n"
            "assert (y == 3).all()\n"
            "print('done')\n")
    procs = spawn(2, EXEC, [program(body)], env={"JACKLRING_STALL_REPORT": "0.5"})
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    procs[1].send_signal(19)  # SIGSTOP
    time.sleep(2)
    procs[1].send_signal(18)  # SIGCONT
    res = collect(procs, timeout=40)
    assert [r.returncode for r in res] == [0, 0], res
    assert "stalled" in res[0].stderr and "rank 1" in res[0].stderr


pytest.mark.timeout(60)
def test_garbage_connection_is_rejected_and_the_job_goes_on():
    hostfile = ring_hostfile(2)
    host, port = json.load(open(hostfile))[0][0].split(":")
    body = ("y = adapter.all_sum(np.ones(5))\nassert (y == 2).all()\nprint('ok')\n")
    procs = spawn(2, EXEC, [program("time.sleep(0.01)\n" + body)], hostfile=hostfile, ranks=[0])
    # rank 0 is listening: connect, send junk, and leave a silent connection open too
    deadline = time.monotonic() + 10
    while True:
        try:
            junk = socket.create_connection((host, int(port)), timeout=1)
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    junk.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 100)
    silent = socket.create_connection((host, int(port)), timeout=1)
    procs += spawn(2, EXEC, [program(body)], hostfile=hostfile, ranks=[1])
    res = collect(procs, timeout=40)
    junk.close()
    silent.close()
    assert [r.returncode for r in res] == [0, 0], [r.stderr for r in res]
    assert "unauthenticated connection from" in res[0].stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("content,message", [
    ("not json", "not valid JSON"),
    ("{}", "non-empty JSON list"),
    ("[[\"127.0.0.1\"]]", "ip:port"),
    ("[[\"127.0.0.1:notaport\"]]", "non-numeric port"),
    ("[[]]", "non-empty list"),
])
def test_malformed_hostfile(tmp_path, content, message):
    path = tmp_path / "hosts.json"
    path.write_text(content)
    res = collect(spawn(1, EXEC, [program("")], hostfile=str(path)), timeout=30)
    assert res[0].returncode != 0
    assert "ConfigError" in res[0].stderr and message in res[0].stderr, res[0].stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank,message", [("abc", "not an integer"), ("5", "out of range")])
def test_bad_rank(rank, message):
    hostfile = ring_hostfile(2)
    env = dict(os.environ, MLX_HOSTFILE=hostfile, MLX_RANK=rank, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", "import adapter; adapter.init(backend='ring')"],
                          env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_port_in_use_names_the_rank_and_address():
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    port = blocker.getsockname()[1]
    from adapter.backends.ring.backend import RingBackend
    from adapter.errors import PeerError
    with pytest.raises(PeerError, match=f"rank 0: cannot listen on 127.0.0.1:{port}"):
        RingBackend.from_addresses(0, [[f"127.0.0.1:{port}"], [f"127.0.0.1:{free_ports(1)[0]}"]])
    blocker.close()


@pytest.mark.timeout(60)
def test_a_hostfile_shorter_than_the_started_ranks_fails_on_every_rank(tmp_path):
    """Two ranks started (RANK/WORLD_SIZE as the launcher sets them), a hostfile of one entry:
    rank 0 used to run alone as a group of one while rank 1 failed."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_ports(1)[0]}"]]))
    code = "import adapter; g = adapter.init(backend='ring'); print('SIZE', g.size())"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, MLX_HOSTFILE=str(hostfile), MLX_RANK=str(r), RANK=str(r),
                                       WORLD_SIZE="2", PYTHONPATH=ROOT))
             for r in range(2)]
    out = [p.communicate(timeout=30) for p in procs]
    assert [p.returncode for p in procs] == [1, 1], out
    assert "ConfigError: rank 0: the launcher started 2 ranks (WORLD_SIZE=2) but MLX_HOSTFILE" in out[0][1], out
    assert "lists 1: every rank needs its own entry" in out[0][1], out
    assert ("ConfigError: MLX_RANK=1 is out of range (world size 1: MLX_HOSTFILE " in out[1][1]
            and "lists 1 rank, the launcher started 2 (WORLD_SIZE=2))" in out[1][1]), out


@pytest.mark.parametrize("rank", ["2", "-1"])
def test_mlx_rank_out_of_range_names_the_hostfile_and_its_size(rank):
    hostfile = ring_hostfile(2)
    env = dict(os.environ, MLX_HOSTFILE=hostfile, MLX_RANK=rank, PYTHONPATH=ROOT)
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-c", "import adapter; adapter.init(backend='ring')"],
                          env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert (f"ConfigError: MLX_RANK={rank} is out of range (world size 2: MLX_HOSTFILE {hostfile!r} "
            f"lists 2 ranks)") in proc.stderr, proc.stderr


def test_world_size_of_another_launcher_is_not_taken_for_ours(tmp_path):
    """WORLD_SIZE only counts when RANK names the same rank as MLX_RANK."""
    from adapter import config
    from adapter.errors import ConfigError
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLX_RANK", "0")
        mp.setenv("WORLD_SIZE", "8")
        mp.setenv("RANK", "3")
        assert config.env_rank(2, "MLX_HOSTFILE 'x'") == 0
        mp.setenv("RANK", "0")
        with pytest.raises(ConfigError, match=r"started 8 ranks \(WORLD_SIZE=8\) but MLX_HOSTFILE 'x' lists 2"):
            config.env_rank(2, "MLX_HOSTFILE 'x'")
