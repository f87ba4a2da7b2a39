"""Helpers for launcher tests: run the real `launcher` in a subprocess, read rank output."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # for sshd.py

from sshd import ssh_client_home, ssh_servers  # noqa: E402,F401  (fixtures)

SCRIPTS = Path(__file__).resolve().parent / "scripts"
LAUNCHER = [sys.executable, "-m", "launcher.cli"]
RUN_TIMEOUT = 40


def base_env(**extra) -> dict:
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)  # the default backend must not depend on the caller
    env["OMPI_MCA_btl_tcp_if_include"] = "lo"
    # Chosen by the caller, so the launcher's one-line OMP_NUM_THREADS notice stays out of the
    # stderr these tests compare (test_output.py checks the notice itself).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def launch(*args, input="", env=None, timeout=RUN_TIMEOUT, cwd=None):
    """Run the launcher to completion; returns CompletedProcess (text)."""
    return subprocess.run(
        [*LAUNCHER, *map(str, args)], input=input, capture_output=True, text=True,
        env=env or base_env(), timeout=timeout, cwd=cwd or SCRIPTS)


def start_launcher(*args, env=None, cwd=None, stdin=subprocess.DEVNULL):
    return subprocess.Popen(
        [*LAUNCHER, *map(str, args)], stdin=stdin, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=env or base_env(), cwd=cwd or SCRIPTS,
        start_new_session=True)


def rank_envs(stdout: str) -> dict:
    """{rank: envdump record} from prefixed `[r] ENV {...}` lines."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("[") and "] ENV " in line:
            rank, _, payload = line[1:].partition("] ENV ")
            out[int(rank)] = json.loads(payload)
    return out


def wait_for_pids(pid_dir: Path, count: int, timeout: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(pid_dir.glob("*.pid"))
        if len(files) == count:
            return [int(p) for f in files for p in f.read_text().split()]
        time.sleep(0.05)
    raise AssertionError(f"only {len(list(pid_dir.glob('*.pid')))} of {count} ranks started")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie whose parent has not reaped it yet is already dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_all_dead(pids, timeout: float = 5.0) -> None:
    """Every pid gone (allowing `timeout` s for the kernel and reapers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    for p in left:  # do not leak into other tests, but still fail
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left behind: {left}"


def free_port_pair(first: str = "127.0.0.2", second: str = "127.0.0.3") -> int:
    """A port p free on `first` with p + 1 free on `second` (ring: consecutive ports)."""
    import socket
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind((first, 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            try:
                b.bind((second, port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no consecutive free ports found")
