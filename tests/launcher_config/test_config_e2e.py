"""launcher-config end to end over real ssh (sshd on 127.0.0.2 and 127.0.0.3), Linux ethernet
path, no auto-setup; the hostfile it writes then runs a ring job with `launcher`."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from sshd import ssh_servers, write_ssh_config  # noqa: F401  (ssh_servers is a pytest fixture)

from launcher.config.netplan import Command
from launcher.config.ssh import RemoteHosts
from launcher.hostfile import load_hostfile

pytestmark = pytest.mark.timeout(90)
RUN_TIMEOUT_S = 60


def config_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.config.cli", *args],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)


@pytest.fixture
def ssh_config(ssh_servers, tmp_path) -> Path:  # noqa: F811
    return write_ssh_config(ssh_servers, tmp_path / "ssh_config")


def test_ethernet_hostfile_from_real_ssh_runs_a_ring_job(ssh_config, tmp_path):
    hostfile_path = tmp_path / "hosts.json"
    done = config_cli("--hosts", "127.0.0.2,127.0.0.3", "--over", "ethernet", "--ssh-config", str(ssh_config),
                      "--no-auto-setup", "--env", "JACKLRING_E2E=from-config", "--output", str(hostfile_path),
                      "--verbose")
    assert done.returncode == 0, done.stderr
    assert "127.0.0.2: reachable (Linux" in done.stderr
    hostfile = load_hostfile(hostfile_path)        # the launcher's own parser accepts it
    assert hostfile.backend == "ring"
    assert [(h.ssh, h.ips) for h in hostfile.hosts] == [("127.0.0.2", ["127.0.0.2"]), ("127.0.0.3", ["127.0.0.3"])]
    assert hostfile.envs == ["JACKLRING_E2E=from-config"]

    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os
        import numpy as np
        import adapter
        g = adapter.init(backend="ring", strict=True)
        total = adapter.all_sum(np.array([g.rank() + 1.0, 10.0], dtype=np.float32))
        print(f"rank {g.rank()} of {g.size()} sum {total.tolist()} env {os.environ['JACKLRING_E2E']}", flush=True)
    """))
    job = subprocess.run([sys.executable, "-m", "launcher.cli", "--hostfile", str(hostfile_path),
                          "--ssh-config", str(ssh_config), "--cwd", str(Path.cwd()), str(script)],
                         capture_output=True, text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert job.returncode == 0, job.stdout + job.stderr
    for rank in (0, 1):
        assert f"rank {rank} of 2 sum [3.0, 20.0] env from-config" in job.stdout, job.stdout + job.stderr


def test_dot_over_ethernet_shows_both_hosts_on_the_lan(ssh_config):
    done = config_cli("--hosts", "127.0.0.2,127.0.0.3", "--over", "ethernet", "--ssh-config", str(ssh_config), "--dot")
    assert done.returncode == 0, done.stderr
    assert 'h0 -- lan [label="127.0.0.2"];' in done.stdout and 'h1 -- lan [label="127.0.0.3"];' in done.stdout


def test_unreachable_host_is_reported_then_stops_or_is_dropped(ssh_config, tmp_path):
    hosts = "127.0.0.2,127.0.0.3,127.0.0.9"       # nothing listens on 127.0.0.9:22
    done = config_cli("--hosts", hosts, "--over", "ethernet", "--ssh-config", str(ssh_config),
                      "--connect-timeout", "5")
    assert done.returncode == 2
    assert "launcher-config: 127.0.0.9: unreachable: connection refused (127.0.0.9 port 22)" in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("launcher-config: error: cannot reach 127.0.0.9 over ssh")
    assert "Traceback" not in done.stderr and done.stdout == ""

    out = tmp_path / "two.json"
    done = config_cli("--hosts", hosts, "--over", "ethernet", "--ssh-config", str(ssh_config),
                      "--connect-timeout", "5", "--ignore-unreachable", "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert "leaving out unreachable hosts: 127.0.0.9" in done.stderr
    # said without --verbose: a run with --output has no other output
    assert f"launcher-config: wrote the ring hostfile for 2 hosts to {out}\n" in done.stderr, done.stderr
    assert [h.ssh for h in load_hostfile(out).hosts] == ["127.0.0.2", "127.0.0.3"]


@pytest.mark.parametrize("args, message", [
    (["--hosts", "127.0.0.2", "--env", "NOEQUALS"], "--env 'NOEQUALS': expected KEY=VALUE"),
    (["--hostfile", "/nonexistent/hosts.json"], "/nonexistent/hosts.json: cannot read hostfile"),
    (["--hosts", "127.0.0.2,127.0.0.2"], "host 127.0.0.2 is listed twice"),
    (["--hosts", "127.0.0.2", "--backend", "mpi"], "argument --backend: invalid choice"),
    ([], "one of the arguments --hosts --hostfile is required"),
])
def test_usage_errors_are_one_line_and_exit_2(args, message):
    done = config_cli(*args)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def test_thunderbolt_on_linux_hosts_and_jaccl_without_rdma_fail_clearly(ssh_config):
    done = config_cli("--hosts", "127.0.0.2,127.0.0.3", "--ssh-config", str(ssh_config))
    assert done.returncode == 2
    assert done.stderr.strip() == ("launcher-config: error: --over thunderbolt discovers cables on macOS hosts "
                                   "only; 127.0.0.2, 127.0.0.3 run another system (use --over ethernet)")
    done = config_cli("--hosts", "127.0.0.2,127.0.0.3", "--over", "ethernet", "--backend", "jaccl",
                      "--ssh-config", str(ssh_config))
    assert done.returncode == 2 and "127.0.0.2: no RDMA device found" in done.stderr


def test_hostfile_input_keeps_its_envs(ssh_config, tmp_path):
    source = tmp_path / "in.json"
    source.write_text(json.dumps({"envs": ["A=1"], "hosts": [{"ssh": "127.0.0.3"}, {"ssh": "127.0.0.2"}]}))
    done = config_cli("--hostfile", str(source), "--over", "ethernet", "--ssh-config", str(ssh_config),
                      "--env", "B=2")
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout.split("========\n", 1)[1])
    assert printed["envs"] == ["A=1", "B=2"]
    assert [h["ips"] for h in printed["hosts"]] == [["127.0.0.3"], ["127.0.0.2"]]


def test_access_check_and_command_runner_over_real_ssh(ssh_servers, ssh_config):  # noqa: F811
    with RemoteHosts(["127.0.0.2", "127.0.0.3"], ssh_config=str(ssh_config), connect_timeout=5,
                     command_timeout=20) as remote:
        report = remote.check_access()
        assert [e.reachable for e in report] == [True, True]
        assert all(e.access.system == "Linux" and e.can_sudo for e in report)
        assert [e.access.ssh_server_address for e in report] == ["127.0.0.2", "127.0.0.3"]
        # apply() stops a host at its first failing command and names it; best-effort ones go on.
        # (Harmless commands only: tests never change the machine's network.)
        outcomes = remote.apply([[Command(("false",), may_fail=True), Command(("true",))],
                                 [Command(("true",)), Command(("sh", "-c", "exit 3")), Command(("true",))]],
                                use_sudo=[False, False])
        assert outcomes[0].ok
        assert not outcomes[1].ok and outcomes[1].error == "link setup exited with 1: failed: sh -c 'exit 3'"


def test_a_silent_host_fails_within_its_deadline(ssh_servers, tmp_path):  # noqa: F811
    # Accepts TCP, never sends an ssh banner: the per-host deadline must end the wait.
    silent = socket.socket()
    silent.bind(("127.0.0.4", 0))
    silent.listen(4)
    try:
        config = write_ssh_config(ssh_servers, tmp_path / "ssh_config")
        with open(config, "a") as f:
            f.write(f"\nHost 127.0.0.4\n    Port {silent.getsockname()[1]}\n    User root\n")
        started = time.monotonic()
        with RemoteHosts(["127.0.0.2", "127.0.0.4"], ssh_config=str(config), connect_timeout=2,
                         command_timeout=5) as remote:
            report = remote.check_access()
        assert report[0].reachable
        assert not report[1].reachable
        assert report[1].error.startswith("ssh handshake did not complete within 2 s"), report[1].error
        assert time.monotonic() - started < 20    # bounded by the deadlines, not paramiko's defaults
    finally:
        silent.close()
