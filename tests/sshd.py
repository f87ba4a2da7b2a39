"""A real OpenSSH server on a loopback alias, for tests that need "remote" hosts.

No pytest needed to use it; no change to /etc/ssh. Each server gets its own temp dir
with an sshd_config, a generated host key, and an authorized_keys holding a generated
client key, and listens on a free port of its loopback address (127.0.0.2, 127.0.0.3, ...
work without setup on Linux).

    from tests.sshd import start_sshd, write_ssh_config
    server = start_sshd("127.0.0.2")
    server.target          # "root@127.0.0.2:40123"  (what a hostfile "ssh" field can hold)
    server.connect_kwargs  # Fabric/paramiko connect_kwargs: the client key, no agent
    server.ssh_config_path # an ssh_config with "Host 127.0.0.2" -> port, user, key
    server.stop()

Several servers can share one client key (start_sshd(ip, client_key=first.key_path)), and
write_ssh_config(servers, path) writes one ssh_config (a `Host <alias>` block per server, the
alias defaulting to its ip) that Fabric and OpenSSH's `ssh -F` both honour. Put that file
at $HOME/.ssh/config of a temporary HOME (make_client_home does that) and Fabric picks it
up as it would on a real client. Fixtures (pytest): ssh_servers, ssh_client_home.

sshd runs as the current user (root in CI: PermitRootLogin prohibit-password); it needs
an absolute path (/usr/sbin/sshd) and its privilege separation dir /run/sshd, created here.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from jacklring_shared import ports as port_choice

SSHD = "/usr/sbin/sshd"
SSH_KEYGEN = shutil.which("ssh-keygen") or "/usr/bin/ssh-keygen"
START_TIMEOUT = 10.0


def sshd_available() -> Optional[str]:
    """None when an sshd can be started here, else the reason (for pytest.skip)."""
    if not os.path.exists(SSHD):
        return f"{SSHD} not found (apt-get install openssh-server)"
    if not os.path.exists(SSH_KEYGEN):
        return "ssh-keygen not found (apt-get install openssh-client)"
    return None


def generate_key(path: Path) -> Path:
    """An unencrypted ed25519 key pair at path / path.pub."""
    path = Path(path)
    subprocess.run(
        [SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", "jacklring-test", "-f", str(path)],
        check=True, timeout=30, stdin=subprocess.DEVNULL,
    )
    return path


def free_port(host: str) -> int:
    return port_choice.free_ports([host])[0]  # below the ephemeral range


@dataclass
class SshServer:
    host: str
    port: int
    user: str
    key_path: Path                 # client private key accepted by this server
    host_key_path: Path
    workdir: Path
    ssh_config_path: Path          # ssh_config with `Host <host>` for this server only
    process: subprocess.Popen = field(repr=False)
    _owns_workdir: bool = field(default=True, repr=False)

    @property
    def target(self) -> str:
        """`user@host:port`, the form the launcher accepts in a hostfile's "ssh"."""
        return f"{self.user}@{self.host}:{self.port}"

    @property
    def connect_kwargs(self) -> dict:
        """For fabric.Connection(..., connect_kwargs=...) or paramiko's connect()."""
        return {"key_filename": str(self.key_path), "look_for_keys": False, "allow_agent": False}

    def ssh_command(self, *remote: str) -> list[str]:
        """An OpenSSH client command line that runs `remote` on this server."""
        return ["ssh", "-F", str(self.ssh_config_path), self.host, *remote]

    def log(self) -> str:
        try:
            return (self.workdir / "sshd.log").read_text()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "SshServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def ssh_config_block(server: SshServer, alias: Optional[str] = None) -> str:
    return "\n".join([
        f"Host {alias or server.host}",
        f"    HostName {server.host}",
        f"    Port {server.port}",
        f"    User {server.user}",
        f"    IdentityFile {server.key_path}",
        "    IdentitiesOnly yes",
        "    StrictHostKeyChecking no",
        "    UserKnownHostsFile /dev/null",
        "    LogLevel ERROR",
        "",
    ])


def write_ssh_config(servers: Iterable[SshServer], path: Path,
                     aliases: Optional[Iterable[str]] = None) -> Path:
    """One ssh_config covering every server (alias = its ip unless given)."""
    servers = list(servers)
    names = list(aliases) if aliases is not None else [None] * len(servers)
    Path(path).write_text("\n".join(ssh_config_block(s, a) for s, a in zip(servers, names)))
    return Path(path)


def make_client_home(servers: Iterable[SshServer], home: Path,
                     aliases: Optional[Iterable[str]] = None) -> Path:
    """A HOME whose ~/.ssh/config reaches every server by its ip (and by alias if given),
    the way a user's own config would. Run a client with HOME=<this> to use it."""
    servers = list(servers)
    ssh_dir = Path(home) / ".ssh"
    ssh_dir.mkdir(parents=True, exist_ok=True)
    blocks = [ssh_config_block(s) for s in servers]
    if aliases is not None:
        blocks += [ssh_config_block(s, a) for s, a in zip(servers, aliases)]
    (ssh_dir / "config").write_text("\n".join(blocks))
    return Path(home)


def start_sshd(host_ip: str = "127.0.0.2", client_key: Optional[Path] = None,
               workdir: Optional[Path] = None, port: Optional[int] = None) -> SshServer:
    """Start sshd on host_ip (a free port unless given); returns once it answers."""
    reason = sshd_available()
    if reason:
        raise RuntimeError(reason)
    owns = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix=f"sshd-{host_ip}-")) if owns else Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation dir

    host_key = generate_key(workdir / "host_ed25519_key")
    key_path = Path(client_key) if client_key else generate_key(workdir / "client_ed25519_key")
    authorized = workdir / "authorized_keys"
    authorized.write_text(Path(str(key_path) + ".pub").read_text())
    user = getpass.getuser()

    last_error = ""
    for _attempt in range(3):  # a free port can be taken between probe and bind: retry
        chosen = port or free_port(host_ip)
        config = workdir / "sshd_config"
        config.write_text("\n".join([
            f"ListenAddress {host_ip}:{chosen}",
            f"HostKey {host_key}",
            f"PidFile {workdir / 'sshd.pid'}",
            f"AuthorizedKeysFile {authorized}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "StrictModes no",
            "UsePAM no",
            "UseDNS no",
            "PrintMotd no",
            "MaxSessions 64",
            "MaxStartups 64",
            "Subsystem sftp internal-sftp",
            "LogLevel ERROR",
            "",
        ]))
        log = open(workdir / "sshd.log", "ab")
        proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )
        log.close()
        server = SshServer(host=host_ip, port=chosen, user=user, key_path=key_path,
                           host_key_path=host_key, workdir=workdir,
                           ssh_config_path=workdir / "ssh_config", process=proc,
                           _owns_workdir=owns)
        write_ssh_config([server], server.ssh_config_path)
        if _wait_for_banner(server):
            return server
        last_error = server.log().strip()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=5)
        if port:
            break
    if owns:
        shutil.rmtree(workdir, ignore_errors=True)
    raise RuntimeError(f"sshd on {host_ip} did not start: {last_error or 'no banner'}")


def _wait_for_banner(server: SshServer) -> bool:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return False
        try:
            with socket.create_connection((server.host, server.port), timeout=1.0) as s:
                s.settimeout(2.0)
                if s.recv(64).startswith(b"SSH-"):
                    return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


try:  # the pytest fixtures, only when pytest is importable
    import pytest

    @pytest.fixture(scope="session")
    def ssh_servers():
        """Two sshd's on 127.0.0.2 and 127.0.0.3 sharing one client key."""
        reason = sshd_available()
        if reason:
            pytest.skip(reason)
        first = start_sshd("127.0.0.2")
        try:
            second = start_sshd("127.0.0.3", client_key=first.key_path)
        except Exception:
            first.stop()
            raise
        try:
            yield [first, second]
        finally:
            second.stop()
            first.stop()

    @pytest.fixture(scope="session")
    def ssh_client_home(ssh_servers, tmp_path_factory):
        """A HOME with ~/.ssh/config for both servers: by ip, and as node-a / node-b."""
        return make_client_home(ssh_servers, tmp_path_factory.mktemp("ssh-home"),
                                aliases=["node-a", "node-b"])
except ImportError:  # pragma: no cover
    pass
