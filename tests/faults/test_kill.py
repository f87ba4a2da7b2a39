"""kill -9 of one rank in the middle of a large all_sum: every other rank raises within 5 s,
and under the launcher the job stops with a non-zero exit naming the killed rank."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from cluster import RANK_SCRIPT, ROOT, RankProc, base_env, finish_all, mesh_matrix, reports, start, stop_all

DETECT_LIMIT_S = 5.0

# Loops large all_sums until killed (or 40 s pass: then it prints NOERR and the test fails).
LOOP = """
x = np.ones(COUNT, np.float32)
say("PID", os.getpid())
all_sum(np.ones(4, np.float32))
say("READY")
until = time.monotonic() + 40
try:
    while time.monotonic() < until:
        all_sum(x)
except ERRORS as e:
    say("ERR", type(e).__name__, str(e).replace("\\n", " "))
    sys.exit(3)
say("NOERR")
"""


def loop_body(count: int) -> str:
    return LOOP.replace("COUNT", str(count))


def kill_mid_all_sum(backend: str, n: int, tmp_path, count: int, ready_timeout: float,
                     env: dict[str, str] | None = None,
                     shared_memory: bool | None = None) -> tuple[dict[int, float], list[str]]:
    """Kill rank 1 while every rank loops all_sum; returns {survivor: seconds until it raised}
    and the survivors' messages. shared_memory: what every rank's JACCL group must say of itself."""
    body = loop_body(count)
    if shared_memory is not None:
        body = 'say("SHM", group.backend.shared_memory)\n' + body
    procs = start(backend, n, body, tmp_path, env=env)
    try:
        for p in procs:
            p.wait_line("READY", ready_timeout)
        if shared_memory is not None:
            said = [p.wait_line("SHM", 1)[2] for p in procs]
            assert said == [str(shared_memory)] * n, said
        time.sleep(0.5)  # well inside a multi-megabyte all_sum
        killed_at = procs[1].kill(signal.SIGKILL)
        detection = {}
        messages = []
        for p in procs:
            if p.rank == 1:
                continue
            fields = p.wait_line("ERR", 20)
            detection[p.rank] = float(fields[1]) - killed_at
            messages.append(" ".join(fields[2:]))
        codes = finish_all(procs, 20)
    finally:
        stop_all(procs)
    assert codes[1] == -signal.SIGKILL
    assert all(codes[p.rank] == 3 for p in procs if p.rank != 1), reports(procs)
    slow = {r: t for r, t in detection.items() if not t < DETECT_LIMIT_S}
    assert not slow, f"ranks raised only after {slow} s\n{reports(procs)}"
    # every survivor names the killed rank, also one that heard of it from another survivor
    named = ["rank 1 " in m + " " for m in messages]
    assert all(named), messages
    print(f"{backend} n={n}: detection after kill -9 (s): {detection}; messages: {messages}")
    return detection, messages


@pytest.mark.timeout(90)
def test_ring_kill9_mid_all_sum(tmp_path):
    kill_mid_all_sum("ring", 3, tmp_path, 8 << 20, 30)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n, count", [(3, 8 << 20), (4, 16 << 10)], ids=["3-ring-order", "4-mesh-order"])
def test_jaccl_kill9_mid_all_sum(tmp_path, n, count):
    kill_mid_all_sum("jaccl", n, tmp_path, count, 30)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("count", [8 << 20, 4], ids=["8M-floats", "4-floats"])
def test_jaccl_over_shared_memory_kill9_mid_all_sum(tmp_path, count):
    """The ranks share a host and JACKLRING_LOCAL_TRANSPORT=auto: the all_sums run over shared
    memory, whose wait watches the peers' pidfds and mesh sockets."""
    _, messages = kill_mid_all_sum("jaccl", 3, tmp_path, count, 30, env={"JACKLRING_LOCAL_TRANSPORT": "auto"},
                                   shared_memory=True)
    assert all("all_reduce(sum, float32" in m for m in messages), messages


@pytest.mark.timeout(120)
def test_torch_process_group_kill9_mid_all_reduce(tmp_path):
    pytest.importorskip("torch")
    kill_mid_all_sum("torch", 2, tmp_path, 4 << 20, 80)


def start_launcher(args: list[str], body: str, env: dict[str, str]) -> RankProc:
    cmd = [sys.executable, "-m", "launcher.cli", *args, str(RANK_SCRIPT)]
    popen = subprocess.Popen(cmd, env=base_env(FAULT_BODY=body, **env), cwd=str(ROOT),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = RankProc(-1, popen)
    proc.start_readers()
    return proc


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
def test_launcher_exits_nonzero_naming_the_killed_rank(tmp_path, backend):
    if backend == "ring":
        args = ["-n", "3"]
    else:
        hostfile = tmp_path / "hosts.json"
        hostfile.write_text(json.dumps({"backend": "jaccl", "hosts": [
            {"ssh": "127.0.0.1", "ips": ["127.0.0.1"], "rdma": row} for row in mesh_matrix(3)]}))
        args = ["--hostfile", str(hostfile), "--env", "JACKLRING_JACCL_TRANSPORT=tcp"]
    launcher = start_launcher(args, loop_body(4 << 20), {"FAULT_BACKEND": backend})
    try:
        pid = int(launcher.wait_line("PID", 40, rank=1)[2])
        for rank in range(3):
            launcher.wait_line("READY", 30, rank=rank)
        time.sleep(0.3)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        code = launcher.finish(30)
        stopped_after = time.monotonic() - killed_at
    finally:
        stop_all([launcher])
    assert code != 0, launcher.report()
    summary = launcher.stderr.strip().splitlines()[-1]
    assert "rank 1" in summary and ("SIGKILL" in summary or "-9" in summary or "137" in summary), launcher.report()
    assert stopped_after < 15, launcher.report()
    print(f"launcher {backend}: exit {code} {stopped_after:.2f} s after kill -9: {summary}")


RECV_FROM_VICTIM = """
barrier()
say("READY")
if r == 0:
    t = time.monotonic()
    try:
        recv((1000,), np.float32, 1)
    except ERRORS as e:
        say("ERR", type(e).__name__, str(e).replace("\\n", " "))
        sys.exit(3)
    say("NOERR")
else:
    time.sleep(60)
"""


def recv_from_killed_rank(backend: str, tmp_path) -> float:
    procs = start(backend, 2, RECV_FROM_VICTIM, tmp_path, env={"JACKLRING_TIMEOUT": "8"})
    try:
        for p in procs:
            p.wait_line("READY", 30)
        time.sleep(0.3)
        killed_at = procs[1].kill(signal.SIGKILL)
        fields = procs[0].wait_line("ERR", 20)
        finish_all(procs, 10)
    finally:
        stop_all(procs)
    elapsed = float(fields[1]) - killed_at
    print(f"{backend}: recv from a killed rank raised after {elapsed:.2f} s: {' '.join(fields[2:])}")
    assert elapsed < DETECT_LIMIT_S, f"recv raised only after {elapsed:.1f} s: {' '.join(fields[2:])}"
    return elapsed


@pytest.mark.timeout(60)
def test_jaccl_recv_from_a_killed_rank_raises_quickly(tmp_path):
    recv_from_killed_rank("jaccl", tmp_path)


@pytest.mark.timeout(60)
def test_ring_recv_from_a_rank_killed_before_sending_raises_quickly(tmp_path):
    recv_from_killed_rank("ring", tmp_path)
