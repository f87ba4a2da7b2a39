"""The ring's same-host shared-memory transport, with real rank processes on this host."""
from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest
from ranks import ANOTHER_HOST, assert_all_ok, collect, jaccl_env, ring_hostfile, run, spawn

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="shared memory is implemented for Linux")

OPS = "shm/scripts/ops_on_shm.py"
SHM = {"EXPECT_SHM": "1", "JACKLRING_LOCAL_TRANSPORT": "auto"}


def shm_names() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if "jacklring" in name}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_op_and_dtype_over_shared_memory(n):
    # 4 ranks on this 2-core machine are oversubscribed; 64 KiB chunks make 70001 elements
    # (up to 1.1 MB) take many pipelined chunks, the last one partial.
    assert_all_ok(run(n, OPS, ["0,1,5,1023,70001"], timeout=190,
                      env=dict(SHM, JACKLRING_SHM_CHUNK_BYTES="64K")))


@pytest.mark.timeout(120)
def test_one_step_and_chunked_all_reduce_meet_at_the_threshold():
    # 32768 float32 = 128 KiB, the default switch between "everyone reduces everything" and the
    # sliced reduction (other dtypes land on either side); a 16 KiB chunk makes the sliced one run
    # many small chunks, and limits the one-step path to what one chunk holds.
    assert_all_ok(run(3, OPS, ["4095,4096,4097,16383,16384,16385"], timeout=50,
                      env=dict(SHM, JACKLRING_SHM_CHUNK_BYTES="16K")))
    assert_all_ok(run(3, OPS, ["32767,32768,32769"], timeout=50, env=SHM))  # default chunk


@pytest.mark.timeout(90)
def test_unix_sockets_when_asked():
    assert_all_ok(run(2, OPS, ["1,70001"], timeout=80,
                      env={"EXPECT_SHM": "0", "JACKLRING_LOCAL_TRANSPORT": "unix"}))


@pytest.mark.timeout(90)
def test_ranks_disagreeing_on_the_transport_fall_back_to_sockets_together():
    hostfile = ring_hostfile(2)
    procs = spawn(2, OPS, ["1,70001"], hostfile=hostfile, ranks=[0],
                  env={"EXPECT_SHM": "0", "JACKLRING_LOCAL_TRANSPORT": "tcp"})
    procs += spawn(2, OPS, ["1,70001"], hostfile=hostfile, ranks=[1],
                   env={"EXPECT_SHM": "0", "JACKLRING_LOCAL_TRANSPORT": "auto"})
    assert_all_ok(collect(procs, timeout=80))


@pytest.mark.timeout(150)
def test_two_jobs_on_one_host_at_once():
    first = spawn(2, OPS, ["1,70001"], env=SHM)
    second = spawn(3, OPS, ["1,70001"], env=SHM)
    results = collect(first + second, timeout=140)
    assert_all_ok(results)
    assert all("ok on shared memory" in r.stdout for r in results)


@pytest.mark.timeout(60)
def test_mismatch_raises_on_both_sides():
    body = ("import numpy as np, sys, adapter\n"
            "g = adapter.init(strict=True)\n"
            "assert g.backend.state.shm is not None\n"
            "x = np.ones(10, np.float32)\n"
            "try:\n"
            "    adapter.all_max(x) if g.rank() == 1 else adapter.all_sum(x)\n"
            "except adapter.MismatchError as e:\n"
            "    print(e)\n"
            "    sys.exit(3)\n")
    for r in run(2, "ring_scripts/exec.py", [body], timeout=50, env=SHM):
        assert r.returncode == 3, r.stdout + r.stderr
        assert "all_reduce(max" in r.stdout and "all_reduce(sum" in r.stdout


def _read_line(proc: subprocess.Popen, deadline: float) -> str:
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            return proc.stdout.readline()
        if proc.poll() is not None:
            break
    return ""


def another_host_unavailable() -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare to put a rank in another pid namespace (another host, for shared memory)"
    return None


# (the rank killed, the ranks on another host): the whole group on shared memory, then a group
# spanning two hosts where ranks 0 and 1 share memory (run in stages: hierarchy.py) and the
# rank killed is the first rank of the shared host, the other one, or the rank on its own.
# JACCL runs the same stages (its leaders on a mesh): the three kills of a group spanning hosts.
KILLS = [("ring", 0, ()), ("ring", 2, ()), ("ring", 0, (2,)), ("ring", 1, (2,)), ("ring", 2, (2,)),
         ("jaccl", 0, (2,)), ("jaccl", 1, (2,)), ("jaccl", 2, (2,))]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend,victim,elsewhere", KILLS,
                         ids=[f"{b}-kill{v}-elsewhere{''.join(map(str, e)) or '-none'}" for b, v, e in KILLS])
def test_kill_9_mid_collective_survivors_raise_within_a_second_and_nothing_is_left(backend, victim, elsewhere):
    if elsewhere and another_host_unavailable():
        pytest.skip(another_host_unavailable())
    before = shm_names()
    env = dict(SHM, **jaccl_env(3)) if backend == "jaccl" else SHM
    procs = spawn(3, "shm/scripts/kill_loop.py", [str(1 << 20)], env=env,
                  wraps={r: ANOTHER_HOST for r in elsewhere})
    try:
        deadline = time.monotonic() + 60
        pids = []
        for rank, p in enumerate(procs):
            line = _read_line(p, deadline)
            assert line.startswith("READY"), line + (p.stderr.read() if p.poll() is not None else "")
            # A rank on another host prints its pid there; killing its unshare kills it too.
            pids.append(p.pid if rank in elsewhere else int(line.split()[1]))
        # The segment is real shared memory that rank 0 created (a memfd, not a file in /dev/shm).
        with open(f"/proc/{pids[1]}/maps") as f:
            assert "memfd:jacklring-shm" in f.read()
        time.sleep(0.3)  # deep inside the loop of 4 MiB all_sums
        killed_at = time.time()
        os.kill(pids[victim], signal.SIGKILL)
        results = collect(procs, timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert results[victim].returncode == -signal.SIGKILL
    for r in results:
        if r.rank == victim:
            continue
        assert r.returncode == 3, r.stdout + r.stderr
        raised = next(line for line in r.stdout.splitlines() if line.startswith("RAISED"))
        elapsed = float(raised.split()[1]) - killed_at
        assert elapsed < 1.0, f"rank {r.rank} took {elapsed:.3f} s: {raised}"
        assert "PeerError" in raised
        assert f"rank {victim} " in raised, f"rank {r.rank} does not name the killed rank {victim}: {raised}"
    # Nothing named after us in /dev/shm, before or after (the segment never had a name).
    assert shm_names() == before == set()


@pytest.mark.timeout(60)
def test_a_rank_that_never_arrives_gives_a_deadline_error_naming_it():
    # Rank 2 stays away for 4 s, or until ranks 0 and 1 have raised (files beside the hostfile say so).
    body = ("import numpy as np, os, sys, time, adapter\n"
            "g = adapter.init(strict=True)\n"
            "assert g.backend.state.shm is not None\n"
            "raised = os.environ['MLX_HOSTFILE'] + '.raised'\n"
            "if g.rank() == 2:\n"
            "    until = time.monotonic() + 4\n"
            "    while not all(os.path.exists(f'{raised}{q}') for q in (0, 1)) and time.monotonic() < until:\n"
            "        time.sleep(0.05)\n"
            "    sys.exit(0)\n"
            "t = time.monotonic()\n"
            "try:\n"
            "    adapter.all_sum(np.ones(10, np.float32))\n"
            "except adapter.DistributedError as e:\n"
            "    print(round(time.monotonic() - t, 2), type(e).__name__, e)\n"
            "    open(f'{raised}{g.rank()}', 'w').close()\n"
            "    sys.exit(3)\n")
    res = run(3, "ring_scripts/exec.py", [body], timeout=50, env=dict(SHM, JACKLRING_TIMEOUT="1"))
    for r in res[:2]:
        assert r.returncode == 3, r.stdout + r.stderr
        elapsed = float(r.stdout.split()[0])
        assert 0.9 < elapsed < 3, r.stdout
    # The first to reach its deadline names rank 2; the other may instead learn that it gave up.
    timeouts = [r.stdout for r in res[:2] if "CollectiveTimeout" in r.stdout]
    assert timeouts and all("rank 2" in t and "timed out" in t for t in timeouts), [r.stdout for r in res]
