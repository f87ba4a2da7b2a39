"""Output plumbing: progress bars on a terminal, in pipes and in --log-dir files; a log file
that cannot be written; the summary naming the rank that ended first; OMP_NUM_THREADS."""
from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import time

import pytest
from conftest import LAUNCHER, SCRIPTS, base_env, launch

BAR_FINAL = re.compile(rb"epoch (\d): 100%\|[^|]*\| 30/30")


def env_without_threads(**extra) -> dict:
    env = base_env()
    env.pop("OMP_NUM_THREADS", None)
    return dict(env, **extra)


@pytest.mark.timeout(60)
def test_progress_bar_in_a_pipe_and_log_is_its_final_state_once(tmp_path):
    r = launch("-n", 2, "--log-dir", tmp_path, "progress.py")
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "] [" not in r.stderr, repr(r.stderr)
    bars = [line for line in r.stderr.splitlines() if "epoch" in line]
    assert sorted(line[:12] for line in bars) == ["[0] epoch 0:", "[1] epoch 1:"], bars
    assert all(BAR_FINAL.search(line.encode()) for line in bars), bars
    for rank in (0, 1):
        log = (tmp_path / f"rank{rank}.log").read_bytes()
        assert b"\r" not in log
        # stdout and stderr are separate pipes: their relative order is not defined
        assert sorted(bool(BAR_FINAL.search(line)) for line in log.splitlines()) == [False, False, True], log
        assert f"done {rank}\n".encode() in log


@pytest.mark.timeout(60)
def test_progress_bar_on_a_terminal_rewrites_its_line_with_one_prefix():
    master, slave = pty.openpty()
    proc = subprocess.Popen([*LAUNCHER, "-n", "2", "progress.py"], stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave, cwd=SCRIPTS, env=base_env())
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 50
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the launcher closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=10)
    os.close(master)
    assert proc.returncode == 0, seen
    updates = [seg for line in seen.split(b"\n") for seg in line.split(b"\r") if seg.strip()]
    # every carriage-return update redraws the whole line: its own prefix, exactly one
    assert all(re.match(rb"\[[01]\] ", seg) for seg in updates), updates[:10]
    glued = [seg for seg in updates if re.search(rb"\[[01]\] ", seg[4:])]  # a second prefix inside
    assert not glued, glued[:3]  # (a stdout line glued to a bar on stderr: one terminal, one line)
    bar_updates = [seg for seg in updates if b"epoch" in seg]
    assert len(bar_updates) > 4, "a terminal should see the bar move, not only its end"
    assert {m.group(1) for seg in bar_updates if (m := BAR_FINAL.search(seg))} == {b"0", b"1"}


@pytest.mark.timeout(60)
def test_a_log_file_on_a_full_disk_is_reported_once_and_output_keeps_flowing(tmp_path):
    os.symlink("/dev/full", tmp_path / "rank0.log")  # every write: ENOSPC
    # 3000 lines of 110 bytes: far more than a pipe and the writer's backlog hold together
    r = launch("-n", 2, "--log-dir", tmp_path, "chatty.py", "3000")
    assert r.returncode == 0, r.stderr[-2000:]
    messages = [line for line in r.stderr.splitlines() if line.startswith("launcher:")]
    assert messages == [f"launcher: --log-dir: cannot write {tmp_path}/rank0.log (No space left on device); "
                        "closed it, rank 0's output still goes to the terminal"], messages
    out = r.stdout.splitlines()
    for rank in (0, 1):
        assert sum(line.startswith(f"[{rank}] line ") for line in out) == 3000
    assert len((tmp_path / "rank1.log").read_bytes().splitlines()) == 3000


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["continue", "stop"])
def test_a_log_failure_in_a_job_that_ends_at_once_is_still_said_once(tmp_path, mode):
    """The last lines may be written after every rank has exited: the report must not be lost."""
    os.symlink("/dev/full", tmp_path / "rank0.log")
    r = launch("-n", 2, "--log-dir", tmp_path, "--log-errors", mode, "chatty.py", "1")
    assert r.returncode == (0 if mode == "continue" else 1), r.stderr
    assert r.stderr.count("cannot write") == 1, r.stderr
    assert sum(line.startswith("[0] line 0") for line in r.stdout.splitlines()) == 1


@pytest.mark.timeout(60)
def test_log_errors_stop_ends_the_job_with_a_clear_error(tmp_path):
    os.symlink("/dev/full", tmp_path / "rank1.log")
    start = time.monotonic()
    r = launch("-n", 2, "--log-dir", tmp_path, "--log-errors", "stop", "chatty.py", "10", "60")
    assert r.returncode == 1, r.stderr
    assert time.monotonic() - start < 20, "the job should stop, not sleep its 60 s"
    assert f"cannot write {tmp_path}/rank1.log (No space left on device)" in r.stderr
    assert r.stderr.rstrip().splitlines()[-1] == \
        "launcher: stopped all 2 ranks: a --log-dir file could not be written (--log-errors stop)"


@pytest.mark.timeout(60)
def test_summary_names_the_rank_that_exited_0_early():
    r = launch("-n", 2, "early_end.py", "exit0", env=base_env(JACKLRING_CONNECT_TIMEOUT="20"))
    assert r.returncode == 1, r.stderr
    summary = [line for line in r.stderr.splitlines() if line.startswith("launcher:")]
    assert summary == ["launcher: rank 1 (host 127.0.0.1) ended first: it exited with code 0 while 1 other "
                       "rank was still running",
                       "launcher: rank 0 (host 127.0.0.1) exited with code 1"], r.stderr
    assert "PeerError" in r.stderr


@pytest.mark.timeout(60)
def test_summary_names_the_rank_killed_first():
    r = launch("-n", 2, "early_end.py", "kill9", env=base_env(JACKLRING_CONNECT_TIMEOUT="20"))
    assert r.returncode == 137, r.stderr
    summary = [line for line in r.stderr.splitlines() if line.startswith("launcher:")]
    assert summary[-1].startswith("launcher: rank 1 (host 127.0.0.1) was killed by SIGKILL (exit code 137)"), \
        r.stderr
    assert len(summary) == 1, summary


@pytest.mark.timeout(60)
def test_omp_num_threads_per_rank_said_once():
    r = launch("-n", 2, "envdump.py", env=env_without_threads())
    assert r.returncode == 0, r.stderr
    cores = len(os.sched_getaffinity(0))
    expected = max(1, cores // 2)
    assert r.stderr.splitlines() == [
        f"launcher: setting OMP_NUM_THREADS={expected} for each rank ({cores} cores / 2 local ranks) so ranks "
        "do not oversubscribe the CPUs; set OMP_NUM_THREADS (environment or --env) to choose"]
    envs = [json.loads(line.split("ENV ", 1)[1])["env"] for line in r.stdout.splitlines() if "ENV " in line]
    assert [e["OMP_NUM_THREADS"] for e in envs] == [str(expected)] * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["environment", "--env"])
def test_omp_num_threads_of_the_user_wins_silently(how):
    if how == "environment":
        r = launch("-n", 2, "envdump.py", env=env_without_threads(OMP_NUM_THREADS="3"))
    else:
        r = launch("-n", 2, "--env", "OMP_NUM_THREADS=3", "envdump.py", env=env_without_threads())
    assert r.returncode == 0 and r.stderr == "", r.stderr
    envs = [json.loads(line.split("ENV ", 1)[1])["env"] for line in r.stdout.splitlines() if "ENV " in line]
    assert [e["OMP_NUM_THREADS"] for e in envs] == ["3", "3"]
