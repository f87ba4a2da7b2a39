"""Helpers of the security tests: the outsider is a real process of another user (uid 65534 via
setpriv) running only the standard library, with no access to the job's files or environment.
(A module, not a conftest.py: tests/launcher's helpers are imported as `conftest`, and a second
conftest module would shadow them when both directories run in one session.)"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

ATTACKS = HERE / "attacks"
OUTSIDER_UID = 65534
SYSTEM_PYTHON = "/usr/bin/python3"

# A 2-rank job for the injection tests: rank 1 sends once FAULT_DIR/go exists (after the
# outsider tried its injection), rank 0 receives and prints what it got.
INJECTION_TARGET = """
say("FORMED")
if r == 1:
    go = os.path.join(os.environ["FAULT_DIR"], "go")
    until = time.monotonic() + 30
    while not os.path.exists(go) and time.monotonic() < until:
        time.sleep(0.02)
    send(np.arange(10.0), 0)
else:
    x = recv((10,), np.float64, 1)
    say("GOT", *x.tolist())
"""


def sum_beside_a_squatter(tmp_path: Path, envs: list[dict], env: dict, wrap: list[str] | None = None) -> None:
    """Run a 2-rank ring all_sum (envs: rank_envs) while an outsider's relay.py holds the Unix
    names of the ranks' addresses, relaying to their TCP ports and rewriting every 1.0: the sum
    must be right and each rank must report the squatter."""
    from faults.cluster import finish_all, reports, start, stop_all
    body = "x = all_sum(np.ones(4096, np.float32)); say('SUM', float(x.min()), float(x.max()))"
    procs = start("ring", 2, body, tmp_path, envs=envs, env=env, wrap=wrap)
    try:
        codes = finish_all(procs, 40)
    finally:
        stop_all(procs)
    assert codes == [0, 0], reports(procs)
    for p in procs:
        assert p.tagged("SUM")[0][2:] == ["2.0", "2.0"], reports(procs)
    # detected and reported once per name, not silently
    assert sum(p.stderr.count("squats it") for p in procs) >= 2, reports(procs)


def outsider_available() -> str | None:
    if os.geteuid() != 0:
        return "needs root to run the outsider as another uid"
    if shutil.which("setpriv") is None or not os.path.exists(SYSTEM_PYTHON):
        return "needs setpriv and /usr/bin/python3"
    return None


@pytest.fixture(name="outsider")
def outsider_fixture():
    """outsider(script, *args, wrap=[...]) starts attacks/<script> as uid 65534 from a 0755
    directory holding only the attack scripts, behind the command prefix `wrap` (e.g. `ip
    netns exec NS`: root enters the namespace, then setpriv drops to the outsider); returns
    the Popen (text stdout). All are killed after."""
    reason = outsider_available()
    if reason:
        pytest.skip(reason)
    home = tempfile.mkdtemp(prefix="jacklring-outsider-")
    os.chmod(home, 0o755)
    for script in ATTACKS.glob("*.py"):
        shutil.copy(script, home)
        os.chmod(os.path.join(home, script.name), 0o644)
    procs: list[subprocess.Popen] = []

    def start(script: str, *args: str, wrap: list[str] | None = None) -> subprocess.Popen:
        cmd = [*(wrap or []), "setpriv", f"--reuid={OUTSIDER_UID}", f"--regid={OUTSIDER_UID}", "--clear-groups",
               SYSTEM_PYTHON, "-u", os.path.join(home, script), *map(str, args)]
        proc = subprocess.Popen(cmd, cwd=home, env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    shutil.rmtree(home, ignore_errors=True)


def wait_ready(proc: subprocess.Popen, tag: str = "READY", timeout: float = 15) -> None:
    """The outsider's next line starts with `tag` within `timeout` seconds. Read in a thread, not
    after a select() on the pipe: a slow reader's readline() takes two lines into the text
    buffer at once, and a select() for the second then waits for bytes that already came."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    line = lines[0] if lines else ""
    assert line.startswith(tag), (f"outsider did not start: {line!r} "
                                  f"{proc.stderr.read() if proc.poll() is not None else ''}")
