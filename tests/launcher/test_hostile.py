"""The launcher as a demanding user runs it: bad commands, odd arguments, floods of output,
binary output, stdin that is huge, empty or closed, ranks killed by signals. Real processes."""
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
from conftest import LAUNCHER, SCRIPTS, alive, base_env, launch, rank_envs, start_launcher, wait_for_pids

pytestmark = pytest.mark.timeout(60)

TRICKY_ARGS = ["two words", 'say "hi"', "it's", "$HOME", "`id`", "--", "-n", "", "a;b|c", "*"]


def launcher_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("launcher:")]


@pytest.mark.parametrize("command,code,message", [
    (["missing.py"], 127, "script 'missing.py' not found"),
    (["--", "/nonexistent/program"], 127, "cannot run '/nonexistent/program': not found"),
    (["--", "no-such-command-xyz"], 127, "cannot run 'no-such-command-xyz': not found"),
    (["--", "./README"], 126, "cannot run './README': not an executable file"),
    (["--", "/tmp"], 126, "cannot run '/tmp': not an executable file"),
    (["--python", "/nonexistent/python", "envdump.py"], 127, "cannot run '/nonexistent/python'"),
])
def test_a_program_that_cannot_run_is_one_line_before_any_rank_starts(tmp_path, command, code,
                                                                     message):
    (tmp_path / "README").write_text("not a program\n")
    r = launch("-n", 3, *command, cwd=tmp_path)
    assert r.returncode == code, r.stderr
    assert r.stdout == ""
    assert r.stderr.splitlines() == [f"launcher: error: {r.stderr.split('error: ')[1].strip()}"]
    assert message in r.stderr and "Traceback" not in r.stderr


def test_script_arguments_reach_the_rank_verbatim():
    r = launch("-n", 2, "argv.py", *TRICKY_ARGS)
    assert r.returncode == 0, r.stderr
    got = [json.loads(l.split("ARGV ", 1)[1]) for l in r.stdout.splitlines() if "ARGV " in l]
    assert got == [TRICKY_ARGS, TRICKY_ARGS]


def test_env_values_keep_their_equals_signs_and_contract_variables_win_with_a_warning():
    r = launch("-n", 2, "--env", "URL=a=b==c", "--env", "MLX_RANK=7", "--env", "MLX_HOSTFILE=/x",
               "--env", "MLX_RING_VERBOSE=0", "--env", "MLX_OTHER=kept", "--verbose",
               "envdump.py")
    assert r.returncode == 0, r.stderr
    envs = rank_envs(r.stdout)
    for rank, rec in envs.items():
        env = rec["env"]
        assert env["URL"] == "a=b==c" and env["MLX_OTHER"] == "kept"
        assert env["MLX_RANK"] == str(rank) and env["MLX_HOSTFILE"] != "/x"
        assert env["MLX_RING_VERBOSE"] == "0", "--env beats --verbose's default"
    assert ("launcher: warning: not setting MLX_RANK, MLX_HOSTFILE from --env/envs: "
            "the ring backend sets them for each rank") in r.stderr


def test_verbose_plan_is_a_few_useful_lines():
    r = launch("-n", 3, "--verbose", "--", "true")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == "launcher: backend ring, 3 ranks: true"
    assert lines[1].startswith("launcher: MLX_HOSTFILE = [[\"127.0.0.1:")
    assert [l.split(":")[1] for l in lines[2:]] == [" rank 0 on 127.0.0.1", " rank 1 on 127.0.0.1",
                                                    " rank 2 on 127.0.0.1"]
    assert all("MLX_RANK=" in l and "MLX_RING_VERBOSE=1" in l for l in lines[2:])
    assert len(lines) == 5


def test_missing_local_cwd_is_one_line():
    r = launch("-n", 2, "--cwd", "/nonexistent/dir", "envdump.py")
    assert r.returncode == 2
    assert r.stderr == "launcher: error: --cwd /nonexistent/dir: no such directory\n"


def test_a_flooding_rank_is_stopped_when_another_fails_even_if_nobody_reads(tmp_path):
    """Rank 0 writes without end, rank 1 fails. Nobody reads the launcher's stdout until rank
    0 is dead: a launcher that writes output in its control loop would never stop it."""
    proc = start_launcher("-n", 2, "flood.py", env=base_env(PID_DIR=str(tmp_path)))
    try:
        flooder, failer = wait_for_pids(tmp_path, 2)
        deadline = time.monotonic() + 15
        while alive(flooder) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(flooder), "the flooding rank was not stopped"
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 4, err
    assert launcher_lines(err.decode()) == [
        "launcher: rank 1 (host 127.0.0.1) exited with code 4; stopped the other 1 rank"]
    assert len(out) > 1 << 16 and out.startswith(b"[0] yyy")


def test_twenty_megabytes_of_output_arrive_whole():
    script = ("import sys; sys.stdout.buffer.write((b'z' * 1023 + b'\\n') * 20480); "
              "sys.stdout.flush()")
    r = subprocess.run([*LAUNCHER, "-n", "2", "--", "-c", script],
                       capture_output=True, timeout=40, env=base_env())
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 * 20480
    assert {l for l in lines} == {b"[0] " + b"z" * 1023, b"[1] " + b"z" * 1023}


def test_binary_output_passes_through_byte_for_byte(tmp_path):
    r = subprocess.run([*LAUNCHER, "-n", "2", "--log-dir", str(tmp_path), "binary.py"],
                       capture_output=True, timeout=40, env=base_env(), cwd=SCRIPTS)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        tag = f"[{rank}] ".encode()
        mine = [l for l in r.stdout.split(b"\n") if l.startswith(tag)]
        assert mine == [tag + b"\xff\xfe bad \x80", tag + b"\x00zero", tag + b"partial\xc3"]
        assert (tmp_path / f"rank{rank}.log").read_bytes() == (
            b"\xff\xfe bad \x80\n\x00zero\npartial\xc3\n")


def test_huge_stdin_that_no_rank_reads_does_not_block_the_job(tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(1 << 20) * 24)  # 24 MiB, far beyond any pipe buffer
    with open(big, "rb") as stdin:
        r = subprocess.run([*LAUNCHER, "-n", "2", "--", "sh", "-c", "sleep 0.5; echo done $RANK"],
                           stdin=stdin, capture_output=True, text=True, timeout=40,
                           env=base_env())
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[0] done 0", "[1] done 1"]


@pytest.mark.parametrize("redirect", ["< /dev/null", "<&-"])
def test_empty_or_closed_stdin_gives_ranks_end_of_file(redirect):
    cmd = shlex.join([*LAUNCHER, "-n", "2", "--", "sh", "-c", "cat; echo eof $RANK"])
    r = subprocess.run(["sh", "-c", f"exec {cmd} {redirect}"], capture_output=True, text=True,
                       timeout=30, env=base_env())
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[0] eof 0", "[1] eof 1"]


def test_closed_stdout_and_stderr_are_not_a_crash():
    cmd = shlex.join([*LAUNCHER, "-n", "2", "--", "sh", "-c", "echo out; echo err >&2"])
    r = subprocess.run(["sh", "-c", f"exec {cmd} >&- 2>&-"], capture_output=True, text=True,
                       timeout=30, env=base_env())
    assert r.returncode == 0 and r.stdout == r.stderr == ""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
def test_a_rank_killed_by_a_signal_is_named_and_gives_128_plus_n(sig):
    r = launch("-n", 3, "--", "sh", "-c",
               f'if [ "$RANK" = 1 ]; then sleep 0.3; kill -{sig.value} $$; fi; sleep 30')
    assert r.returncode == 128 + sig.value, r.stderr
    assert launcher_lines(r.stderr) == [
        f"launcher: rank 1 (host 127.0.0.1) was killed by {sig.name} "
        f"(exit code {128 + sig.value}); stopped the other 2 ranks"]


def test_a_rank_that_finishes_early_does_not_stop_the_others():
    r = launch("-n", 3, "--", "sh", "-c", 'if [ "$RANK" != 0 ]; then exit 0; fi; sleep 1; echo still')
    assert r.returncode == 0
    assert r.stdout == "[0] still\n" and r.stderr == "", "no summary noise on success"


def test_the_stopped_count_leaves_out_ranks_that_already_finished():
    r = launch("-n", 3, "--", "sh", "-c",
               'case $RANK in 0) exit 0;; 1) sleep 0.5; exit 9;; *) sleep 30;; esac')
    assert r.returncode == 9
    assert launcher_lines(r.stderr) == [
        "launcher: rank 0 (host 127.0.0.1) ended first: it exited with code 0 while 2 other ranks were still running",
        "launcher: rank 1 (host 127.0.0.1) exited with code 9; stopped the other 1 rank"]


def test_a_single_rank():
    r = launch("-n", 1, "envdump.py")
    assert r.returncode == 0 and r.stderr == ""
    env = rank_envs(r.stdout)[0]
    assert env["env"]["WORLD_SIZE"] == "1" and len(env["files"]["MLX_HOSTFILE"]) == 1
    assert launch("-n", 1, "--", "sh", "-c", "exit 3").returncode == 3


def test_log_dir_is_overwritten_by_the_next_run(tmp_path):
    logs = tmp_path / "logs"
    assert launch("-n", 2, "--log-dir", logs, "streams.py").returncode == 0
    r = launch("-n", 2, "--log-dir", logs, "--", "sh", "-c",
               'if [ "$RANK" = 0 ]; then echo second; fi')
    assert r.returncode == 0, r.stderr
    assert (logs / "rank0.log").read_text() == "second\n"
    assert (logs / "rank1.log").read_text() == "", "a silent rank's log is emptied too"


def test_log_dir_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    r = launch("-n", 2, "--log-dir", tmp_path / "file", "envdump.py")
    assert r.returncode == 2 and launcher_lines(r.stderr) == r.stderr.splitlines()
    assert len(r.stderr.splitlines()) == 1 and "--log-dir" in r.stderr


def _mlx_missing():
    try:
        import mlx.core  # noqa: F401
    except Exception as e:  # ImportError, or a broken native library
        return f"mlx is not importable here ({e})"
    return None


@pytest.mark.skipif(_mlx_missing() is not None, reason=str(_mlx_missing()))
@pytest.mark.timeout(60)
def test_a_real_mlx_program_under_our_launcher():
    r = launch("-n", 3, "mlx_sum.py", timeout=50)
    assert r.returncode == 0, r.stdout + r.stderr
    got = sorted(l.split("] ", 1)[1] for l in r.stdout.splitlines() if "MLX " in l)
    assert got == [f"MLX {rank} 3 {[3.0] * 10}" for rank in range(3)]


@pytest.mark.skipif(_mlx_missing() is not None, reason=str(_mlx_missing()))
@pytest.mark.timeout(60)
def test_our_program_under_mlx_launch():
    mlx_launch = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    if not os.path.exists(mlx_launch):
        pytest.skip(f"mlx is importable but {mlx_launch} is missing")
    r = subprocess.run([mlx_launch, "--backend", "ring", "-n", "2", "--", sys.executable,
                        str(SCRIPTS / "adapter_sum.py")], capture_output=True, text=True,
                       timeout=50, env=base_env(), cwd=SCRIPTS)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [l for l in r.stdout.splitlines() if "SUM" in l] == [f"SUM {[2.0] * 10}"] * 2
