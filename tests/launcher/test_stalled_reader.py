"""A launcher whose stdout nobody reads (`| (sleep 15; cat)`, a paused pager) still acts on
exits and signals at once: the job's fate never waits on the reader of its output."""
import os
import signal
import threading
import time

from conftest import alive, base_env, start_launcher, wait_for_pids


def _read_stderr(proc, lines: list) -> threading.Thread:
    def pump():
        for line in proc.stderr:
            lines.append((time.monotonic(), line.decode()))
    t = threading.Thread(target=pump, daemon=True)
    t.start()
    return t


def _wait_for(path, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return time.monotonic()


def _wait_for_line(lines: list, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in line for _, line in lines):
        assert time.monotonic() < deadline, f"{text!r} never arrived on stderr: {lines}"
        time.sleep(0.02)


def test_a_rank_exit_stops_the_job_while_stdout_is_not_read(tmp_path):
    proc = start_launcher("-n", 2, "stalled_reader.py", env=base_env(PID_DIR=str(tmp_path)))
    err: list = []
    try:
        reader = _read_stderr(proc, err)
        survivor, _ = wait_for_pids(tmp_path, 2)
        exited_at = _wait_for(tmp_path / "1.done", 20)
        while alive(survivor) and time.monotonic() < exited_at + 5:
            time.sleep(0.02)
        stopped_after = time.monotonic() - exited_at
        assert stopped_after < 2.0, f"rank 0 lived {stopped_after:.1f} s after rank 1 exited"
        # stderr is not held back behind the stdout nobody reads: it arrives while stdout is
        # still unread. Waited for, not checked at once: the launcher's stderr writer and this
        # test's reader thread are separate threads that may not have run yet when rank 0 dies.
        _wait_for_line(err, "[1] rank 1 gives up", 10)
        time.sleep(1.0)
        assert proc.poll() is None  # it still has output to deliver: it waits for the reader
        out = proc.stdout.read()  # the reader resumes: everything produced arrives
        proc.wait(timeout=20)
        reader.join(5)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, err
    lines = out.splitlines()
    assert [l[4:8] for l in lines] == [b"%04d" % i for i in range(600)]
    assert err[-1][1] == "launcher: rank 1 (host 127.0.0.1) exited with code 3; stopped the other 1 rank\n"


def test_ctrl_c_is_prompt_while_stdout_is_not_read_and_the_loss_is_said_once(tmp_path):
    proc = start_launcher("-n", 2, "stalled_reader.py",
                          env=base_env(PID_DIR=str(tmp_path), NO_FAIL="1"))
    err: list = []
    try:
        reader = _read_stderr(proc, err)
        pids = wait_for_pids(tmp_path, 2)
        deadline = time.monotonic() + 20
        while not any("gives up" in line for _, line in err):
            assert time.monotonic() < deadline, err
            time.sleep(0.02)
        time.sleep(0.3)
        sent = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=10)
        took = time.monotonic() - sent
        reader.join(5)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < 3.0, f"one Ctrl-C took {took:.1f} s"
    assert proc.returncode == 128 + signal.SIGINT
    assert not any(alive(p) for p in pids)
    said = [line for _, line in err if "gave up on the ranks' output" in line]
    assert len(said) == 1 and "bytes for stdout" in said[0], err
