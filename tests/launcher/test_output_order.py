"""Each rank's lines in the order the rank wrote them, always with its prefix: with output
redirected to one file (`launcher -n 2 x.py > log 2>&1`) a rank's stdout and stderr lines
keep their order, as under plain python; on a terminal (tmux), after a pdb prompt, the
answer to a command the user typed starts its own line with the rank's prefix."""
import os
import shutil
import subprocess
import time

import pytest
from conftest import LAUNCHER, SCRIPTS, base_env


@pytest.mark.timeout(90)
def test_stdout_and_stderr_of_a_rank_keep_their_order_in_one_file(tmp_path):
    log = tmp_path / "log"
    with open(log, "wb") as f:
        r = subprocess.run([*LAUNCHER, "-n", "2", "interleaved.py", "300"], stdout=f, stderr=subprocess.STDOUT,
                           cwd=SCRIPTS, env=base_env(), timeout=80)
    text = log.read_text()
    assert r.returncode == 0, text[-2000:]
    for rank in (0, 1):
        mine = [line[len(f"[{rank}] "):] for line in text.splitlines() if line.startswith(f"[{rank}] ")]
        wanted = [f"{kind} {i}" for i in range(300) for kind in ("out", "err")]
        assert mine == wanted, [(i, a, b) for i, (a, b) in enumerate(zip(mine, wanted)) if a != b][:5]


def _pane(tmux: list[str]) -> str:
    return subprocess.run([*tmux, "capture-pane", "-p", "-t", "job"], capture_output=True, text=True,
                          timeout=10).stdout


def _wait_pane(tmux: list[str], test, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = _pane(tmux)
        if test(text):
            return text
        assert time.monotonic() < deadline, text
        time.sleep(0.2)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
@pytest.mark.timeout(120)
def test_the_answer_after_a_pdb_prompt_keeps_its_prefix(tmp_path):
    tmux = ["tmux", "-S", str(tmp_path / "tmux.sock"), "-f", os.devnull]
    status = tmp_path / "status"
    env = base_env()
    command = " ".join([*LAUNCHER, "-n", "2", "debug_me.py"]) + f"; echo $? > {status}; sleep 60"
    subprocess.run([*tmux, "new-session", "-d", "-s", "job", "-x", "160", "-y", "50", "-c", str(SCRIPTS),
                    "env", *(f"{k}={v}" for k, v in env.items() if k in ("PATH", "PYTHONPATH", "OMP_NUM_THREADS")),
                    "bash", "-c", command], check=True, timeout=20)
    try:
        _wait_pane(tmux, lambda t: t.count("(Pdb)") >= 2, 60)
        time.sleep(0.3)  # both prompts shown before the answer comes
        subprocess.run([*tmux, "send-keys", "-t", "job", "p secret", "Enter"], check=True, timeout=10)
        text = _wait_pane(tmux, lambda t: t.count("42") >= 2, 30)
        subprocess.run([*tmux, "send-keys", "-t", "job", "c", "Enter"], check=True, timeout=10)
        deadline = time.monotonic() + 30
        while not status.exists():
            assert time.monotonic() < deadline, _pane(tmux)
            time.sleep(0.2)
    finally:
        subprocess.run([*tmux, "kill-server"], timeout=10)
    answers = [line for line in text.splitlines() if "42" in line]
    assert sorted(answers) == ["[0] 42", "[1] 42"], text
    assert status.read_text().strip() == "0", text
