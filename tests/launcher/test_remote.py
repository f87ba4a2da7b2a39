"""Remote ranks through Fabric to real sshd's on 127.0.0.2 and 127.0.0.3."""
import json
import os
import signal
import subprocess

import pytest
from conftest import LAUNCHER, SCRIPTS, assert_all_dead, base_env, launch, rank_envs, start_launcher, wait_for_pids
from sshd import write_ssh_config

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def env(ssh_client_home, tmp_path):
    """The launcher's environment: a HOME whose ~/.ssh/config holds the client key."""
    return base_env(HOME=str(ssh_client_home))


def remote_hostfile(tmp_path, servers, backend="ring", extra=()):
    """rank 0 on 127.0.0.2, rank 1 on 127.0.0.3 (user@host:port targets)."""
    path = tmp_path / "hosts.json"
    hosts = [{"ssh": s.target, "ips": [s.host]} for s in servers] + list(extra)
    path.write_text(json.dumps({"backend": backend, "hosts": hosts}))
    return path


def test_remote_ranks_get_env_files_and_cwd(tmp_path, ssh_servers, env):
    hostfile = remote_hostfile(tmp_path, ssh_servers)
    r = launch("--hostfile", hostfile, "--cwd", str(SCRIPTS), "--env", "GREETING=hi",
               "--starting-port", 40400, "envdump.py", env=env)
    assert r.returncode == 0, r.stderr
    envs = rank_envs(r.stdout)
    assert sorted(envs) == [0, 1]
    for rank, rec in envs.items():
        renv = rec["env"]
        assert renv["MLX_RANK"] == str(rank) and renv["GREETING"] == "hi"
        assert rec["cwd"] == str(SCRIPTS)
        assert rec["files"]["MLX_HOSTFILE"] == [["127.0.0.2:40400"], ["127.0.0.3:40401"]]
        assert renv["SSH_CONNECTION"].split()[2] == ssh_servers[rank].host  # really over ssh
        assert renv["MASTER_ADDR"] == "127.0.0.2"
        assert not os.path.exists(renv["MLX_HOSTFILE"]), "remote temp file must be removed"


def test_ssh_config_alias_from_home_and_from_option(tmp_path, ssh_servers, ssh_client_home):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "node-a", "ips": ["127.0.0.2"]},
                                    {"ssh": "node-b", "ips": ["127.0.0.3"]}]))
    r = launch("--hostfile", hostfile, "envdump.py", env=base_env(HOME=str(ssh_client_home)))
    assert r.returncode == 0, r.stderr
    assert sorted(rank_envs(r.stdout)) == [0, 1]
    config = tmp_path / "ssh_config"
    write_ssh_config(ssh_servers, config, aliases=["node-a", "node-b"])
    r = launch("--hostfile", hostfile, "--ssh-config", config, "envdump.py")
    assert r.returncode == 0, r.stderr
    assert sorted(rank_envs(r.stdout)) == [0, 1]


def test_stdin_output_and_stderr_from_remote_ranks(tmp_path, ssh_servers, env):
    hostfile = remote_hostfile(tmp_path, ssh_servers)
    r = launch("--hostfile", hostfile, "--cwd", str(SCRIPTS), "echo_stdin.py", input="ping\n",
               env=env)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        assert [l for l in r.stdout.splitlines() if l.startswith(f"[{rank}]")] == [
            f"[{rank}] got ping", f"[{rank}] eof"]
    r = launch("--hostfile", hostfile, "--cwd", str(SCRIPTS), "streams.py", env=env)
    assert sorted(r.stderr.splitlines()) == ["[0] err 0", "[1] err 1"]


def test_remote_rank_failure_stops_local_and_remote_ranks(tmp_path, ssh_servers, env):
    hostfile = remote_hostfile(tmp_path, ssh_servers, extra=[
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}])
    r = launch("--hostfile", hostfile, "--cwd", str(SCRIPTS), "--env", f"PID_DIR={tmp_path}",
               "behave.py", "--fail-rank", 1,
               "--code", 5, "--delay", 1.5, "--child", "--sleep", 120, env=env)
    assert r.returncode == 5, r.stderr
    assert [l for l in r.stderr.splitlines() if l.startswith("launcher:")] == [
        f"launcher: rank 1 (host {ssh_servers[1].target}) exited with code 5; "
        "stopped the other 2 ranks"]
    assert_all_dead(wait_for_pids(tmp_path, 3))


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_remote_ranks_die_with_the_launcher(tmp_path, ssh_servers, how, env):
    """SIGTERM: the launcher stops them; SIGKILL: the agent sees its ssh session end."""
    hostfile = remote_hostfile(tmp_path, ssh_servers)
    proc = start_launcher("--hostfile", hostfile, "--cwd", str(SCRIPTS),
                          "--env", f"PID_DIR={tmp_path}", "behave.py",
                          "--child", "--sleep", 120, env=env)
    try:
        pids = wait_for_pids(tmp_path, 2)
        proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    if how == "sigterm":
        assert proc.returncode == 143
    assert_all_dead(pids, timeout=10)


def test_missing_remote_cwd_is_an_error(tmp_path, ssh_servers, env):
    hostfile = remote_hostfile(tmp_path, ssh_servers)
    r = launch("--hostfile", hostfile, "--cwd", "/nonexistent/dir", "envdump.py", env=env)
    assert r.returncode == 2
    assert "/nonexistent/dir does not exist" in r.stderr


def test_unreachable_host_is_one_line_and_exit_255(tmp_path, ssh_servers, env):
    server = ssh_servers[0]
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([
        {"ssh": server.target, "ips": ["127.0.0.2"]},
        {"ssh": f"{server.user}@127.0.0.4:1", "ips": ["127.0.0.4"]}]))
    r = launch("--hostfile", hostfile, "envdump.py", env=env)
    assert r.returncode == 255
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launcher: cannot ssh to ") and "127.0.0.4:1" in lines[0]


@pytest.mark.timeout(90)
def test_ring_all_sum_end_to_end_over_ssh(tmp_path, ssh_servers, env):
    """adapter.init + all_sum with one rank behind each sshd, ports from --starting-port."""
    from conftest import free_port_pair
    hostfile = remote_hostfile(tmp_path, ssh_servers)
    r = launch("--hostfile", hostfile, "--cwd", str(SCRIPTS), "--starting-port",
               free_port_pair(), "ring_sum.py", env=env, timeout=80)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(l.split("] ")[1] for l in r.stdout.splitlines() if "sum ok" in l) == [
        "sum ok 0 2 3.0", "sum ok 1 2 3.0"]


def test_remote_rank_killed_on_its_host_stops_the_job(tmp_path, ssh_servers, env):
    hostfile = remote_hostfile(tmp_path, ssh_servers)
    proc = start_launcher("--hostfile", hostfile, "--cwd", str(SCRIPTS),
                          "--env", f"PID_DIR={tmp_path}", "behave.py", "--child",
                          "--sleep", 120, env=env)
    try:
        pids = wait_for_pids(tmp_path, 2)
        rank1 = int((tmp_path / "1.pid").read_text().split()[0])
        os.kill(rank1, signal.SIGKILL)  # "on its host": 127.0.0.3's sshd runs here too
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err.decode()
    assert proc.returncode == 137, err
    assert "[1] launcher: rank process" in err and "was killed by SIGKILL" in err
    assert [l for l in err.splitlines() if l.startswith("launcher:")] == [
        f"launcher: rank 1 (host {ssh_servers[1].target}) exited with code 137 "
        "(128 + 9: killed by SIGKILL); stopped the other 1 rank"]
    assert_all_dead(pids, timeout=10)


def test_remote_arguments_survive_the_ssh_command_line(tmp_path, ssh_servers, env):
    from test_hostile import TRICKY_ARGS
    hostfile = remote_hostfile(tmp_path, ssh_servers)
    r = launch("--hostfile", hostfile, "--cwd", str(SCRIPTS), "argv.py", *TRICKY_ARGS, env=env)
    assert r.returncode == 0, r.stderr
    got = [json.loads(l.split("ARGV ", 1)[1]) for l in r.stdout.splitlines() if "ARGV " in l]
    assert got == [TRICKY_ARGS, TRICKY_ARGS]


def test_connections_opened_in_parallel_never_see_a_half_built_config(tmp_path):
    """Fabric writes key_filename into the Config a Connection was given; a Config shared by
    threads was caught mid-rebuild ("no config key 'gateway'"). Eight refused connections,
    with thread switches forced as often as CPython allows, must all fail for the real reason."""
    import socket
    import sys

    from launcher.ranks import open_connections
    with socket.socket() as s:  # a port nobody listens on: every connect is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(f"Host *\n  IdentityFile {tmp_path / 'no_key'}\n")
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        targets = [f"user{i}@127.0.0.1:{port}" for i in range(8)]
        results = open_connections(targets, str(ssh_config), timeout=10)
    finally:
        sys.setswitchinterval(old)
    errors = [str(results[t]) for t in targets]
    assert all("gateway" not in e and "config key" not in e for e in errors), errors
    assert all("cannot ssh to" in e for e in errors), errors


@pytest.mark.timeout(120)
def test_restart_failed_starts_the_replacement_over_ssh_on_the_dead_ranks_host(tmp_path, ssh_servers, env):
    """Three ranks behind two sshd's; rank 1 (on 127.0.0.3) SIGKILLs itself at step 3: the
    launcher starts its replacement over ssh on 127.0.0.3, the survivors shrink and grow, and
    the replacement finishes the steps as rank 2 of 3 with the others."""
    from conftest import free_port_pair
    first, second = ssh_servers
    hostfile = remote_hostfile(tmp_path, ssh_servers, extra=[{"ssh": first.target, "ips": [first.host]}])
    r = launch("--hostfile", hostfile, "--cwd", str(SCRIPTS), "--starting-port", free_port_pair(),
               "--restart-failed", 1, "replace.py", "--victim", 1, "--kill-at", 3, "--steps", 8,
               env=env, timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    done = sorted(line.split("] ")[1].split()[1:] for line in r.stdout.splitlines() if "] done " in line)
    assert done == [["0", "0", "3", "8"], ["1", "2", "3", "8"], ["2", "1", "3", "8"]], r.stdout
    said = [line for line in r.stderr.splitlines() if line.startswith("launcher:")]
    assert said[0] == (f"launcher: rank 1 (host {second.target}) exited with code 137 (128 + 9: killed by "
                       f"SIGKILL); starting a replacement (--restart-failed: 1 of 1 used)"), said
    assert "joined 1 as rank 2 of 3 at step 3" in r.stdout, r.stdout
    assert said[-1] == ("launcher: finished with 3 of 3 ranks after 1 replacement (--restart-failed 1); "
                        "replaced rank 1"), said


def test_remote_ranks_keep_their_line_order_in_one_file(tmp_path, ssh_servers, env):
    """`> log 2>&1`: the agent gives the rank one pipe for both streams, so its order holds."""
    hostfile = remote_hostfile(tmp_path, ssh_servers)
    log = tmp_path / "log"
    with open(log, "wb") as f:
        r = subprocess.run([*LAUNCHER, "--hostfile", str(hostfile), "--cwd", str(SCRIPTS), "interleaved.py", "200"],
                           stdout=f, stderr=subprocess.STDOUT, cwd=SCRIPTS, env=env, timeout=50)
    text = log.read_text()
    assert r.returncode == 0, text[-2000:]
    for rank in (0, 1):
        mine = [line[len(f"[{rank}] "):] for line in text.splitlines() if line.startswith(f"[{rank}] ")]
        assert mine == [f"{kind} {i}" for i in range(200) for kind in ("out", "err")], mine[:6]
