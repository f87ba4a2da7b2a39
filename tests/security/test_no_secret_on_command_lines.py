"""No secret on any command line: the job secret and the user's --env values reach local, ssh
and mpirun ranks through environments and stdin only, so `ps` (any user can read every
process's /proc/PID/cmdline) shows neither, not even base64-encoded."""
from __future__ import annotations

import base64
import binascii
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sshd import ssh_client_home, ssh_servers  # noqa: F401  (fixtures)

from jacklring_shared.secret_text import DRAWN_PREFIX

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TOKEN = "api-token-5f0c1d9e7a"


def command_lines() -> list[tuple[int, list[str]]]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                raw = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            out.append((int(entry), raw.decode(errors="replace").split("\0")))
    return out


def leaks(values: list[str]) -> list[str]:
    found = []
    for pid, argv in command_lines():
        for arg in argv:
            decoded = ""
            if len(arg) >= 16:
                try:
                    decoded = base64.b64decode(arg, validate=True).decode(errors="replace")
                except (binascii.Error, ValueError):
                    pass
            for value in values:
                if value and (value in arg or value in decoded):
                    found.append(f"pid {pid}: {' '.join(argv)[:200]}")
    return found


def hostfile(tmp_path: Path, backend: str, hosts: list[dict]) -> str:
    """The user's secret-bearing variable comes from the hostfile's envs (a file), as it would."""
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"backend": backend, "envs": [f"API_TOKEN={TOKEN}"], "hosts": hosts}))
    return str(path)


def run_and_inspect(tmp_path: Path, args: list[str], ranks: int, env: dict | None = None) -> tuple[list[str], list]:
    hold = tmp_path / "hold"
    hold.mkdir()
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    full_env.pop("JACKLRING_SECRET", None)
    full_env["OMPI_MCA_btl_tcp_if_include"] = "lo"
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", *args, "--env", f"HOLD_DIR={hold}",
                             "--cwd", str(SCRIPTS), "hold_secret.py"],
                            cwd=str(SCRIPTS), env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 40
        while len(list(hold.glob("rank*.txt"))) < ranks:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "ranks did not start"
            time.sleep(0.05)
        records = [f.read_text().split("\n") for f in sorted(hold.glob("rank*.txt"))]
        secrets_seen = {r[0] for r in records}
        assert len(secrets_seen) == 1, records
        secret = secrets_seen.pop()  # one 256-bit secret, in the launcher's drawn form
        assert secret.startswith(DRAWN_PREFIX) and len(bytes.fromhex(secret[len(DRAWN_PREFIX):])) == 32, records
        assert all(r[1] == TOKEN for r in records)
        found = leaks([secret, secret[len(DRAWN_PREFIX):], TOKEN])  # the digits alone are the secret too
        (hold / "go").touch()
        out, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + err
    return found, records


@pytest.mark.timeout(90)
def test_local_ranks(tmp_path):
    local = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2
    found, _ = run_and_inspect(tmp_path, ["--hostfile", hostfile(tmp_path, "ring", local)], 2)
    assert not found, found


@pytest.mark.timeout(90)
def test_mpirun_ranks(tmp_path):
    from launcher.mpi import find_mpirun
    if find_mpirun(sys.executable) is None:
        pytest.skip("no mpirun")
    local = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2
    found, _ = run_and_inspect(tmp_path, ["--hostfile", hostfile(tmp_path, "mpi", local)], 2)
    assert not found, found


@pytest.mark.timeout(90)
def test_ssh_ranks(tmp_path, ssh_servers, ssh_client_home):  # noqa: F811  (fixtures)
    remote = [{"ssh": s.target, "ips": [s.host]} for s in ssh_servers]
    found, _ = run_and_inspect(tmp_path, ["--hostfile", hostfile(tmp_path, "ring", remote), "--starting-port", "40950"], 2,
                               env={"HOME": str(ssh_client_home)})
    assert not found, found


@pytest.mark.timeout(90)
def test_remote_master_port_is_chosen_free_on_rank0s_host(tmp_path, ssh_servers, ssh_client_home):  # noqa: F811
    """Not the fixed 29500 an outsider could squat in advance: a port found free over ssh."""
    remote = [{"ssh": s.target, "ips": [s.host]} for s in ssh_servers]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(ssh_client_home))
    scripts = ROOT / "tests" / "launcher" / "scripts"
    r = subprocess.run([sys.executable, "-m", "launcher.cli", "--hostfile", hostfile(tmp_path, "ring", remote),
                        "--starting-port", "40960", "--cwd", str(scripts), "envdump.py"],
                       cwd=str(scripts), env=env, capture_output=True, text=True, timeout=80)
    assert r.returncode == 0, r.stdout + r.stderr
    ports = {json.loads(line.split("] ENV ", 1)[1])["env"]["MASTER_PORT"]
             for line in r.stdout.splitlines() if "] ENV " in line}
    assert len(ports) == 1
    port = int(ports.pop())
    assert port != 29500 and 0 < port < 65536


def _launch(tmp_path: Path, *args: str, secret: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("JACKLRING_SECRET", None)
    env.pop("JACKLRING_SECRET_FILE", None)
    if secret is not None:
        env["JACKLRING_SECRET"] = secret
    return subprocess.run([sys.executable, "-m", "launcher.cli", "-n", "2", *args, "--", sys.executable, "-c",
                           "print('RAN')"], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(60)
def test_the_launcher_refuses_a_secret_in_its_own_argv(tmp_path):
    r = _launch(tmp_path, "--env", "JACKLRING_SECRET=" + "ab" * 32)
    assert r.returncode != 0 and "RAN" not in r.stdout, r.stdout + r.stderr
    assert "JACKLRING_SECRET_FILE" in r.stderr and "command line" in r.stderr, r.stderr


@pytest.mark.timeout(60)
def test_the_launcher_refuses_a_secret_file_other_users_can_read_as_the_ranks_would(tmp_path):
    path = tmp_path / "secret"
    path.write_text("cd" * 32)
    path.chmod(0o644)
    r = _launch(tmp_path, "--env", f"JACKLRING_SECRET_FILE={path}")
    assert r.returncode != 0 and "RAN" not in r.stdout, r.stdout + r.stderr
    assert "readable by other users" in r.stderr, r.stderr
    path.chmod(0o600)
    r = _launch(tmp_path, "--env", f"JACKLRING_SECRET_FILE={path}")
    assert r.returncode == 0 and r.stdout.count("RAN") == 2, r.stdout + r.stderr


@pytest.mark.timeout(60)
def test_the_launcher_refuses_a_weak_passphrase_as_the_ranks_would(tmp_path):
    r = _launch(tmp_path, secret="correct horse battery staple!")
    assert r.returncode != 0 and "RAN" not in r.stdout, r.stdout + r.stderr
    assert "weak passphrase" in r.stderr, r.stderr
