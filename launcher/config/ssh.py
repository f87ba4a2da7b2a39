"""The only part of launcher-config that talks to hosts: one Fabric Connection per host,
commands run on all hosts in parallel, each under its own deadline.

Fabric is imported lazily so the parsers and planners work (and test) without it. Host
names go through Fabric's usual ssh_config handling (~/.ssh/config, or --ssh-config).
"""
from __future__ import annotations

import logging
import shlex
import socket
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

from ..hostfile import parse_ssh_target
from .discovery import ACCESS_PROBE, AccessInfo, ProbeError, parse_access
from .netplan import Command

# paramiko's transport thread logs failed handshakes with a traceback; we report them ourselves
# as one line, so keep its records away from Python's last-resort stderr handler.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_COMMAND_TIMEOUT = 60.0


class SshError(RuntimeError):
    """Fabric is missing or a host could not be used; the message is one line."""


@dataclass
class Outcome:
    """What one host answered: stdout, or an error line saying why not."""

    target: str
    stdout: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class HostAccess:
    target: str
    access: AccessInfo | None = None
    error: str | None = None

    @property
    def reachable(self) -> bool:
        return self.access is not None

    @property
    def can_sudo(self) -> bool:
        return self.access is not None and (self.access.is_root or self.access.has_sudo)


def describe_error(exc: BaseException, target: str, timeout: float) -> str:
    """One line per failure kind, phrased for someone fixing their ssh setup."""
    name = type(exc).__name__
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, socket.gaierror):
        return f"unknown host name ({text})"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"no answer within {timeout:g} s (host down or firewalled?)"
    if name == "AuthenticationException" or name == "BadAuthenticationType":
        return "authentication failed: passwordless (key) ssh is not set up for this host"
    if name == "NoValidConnectionsError":  # paramiko: {(addr, port): error} per address tried
        where = ", ".join(f"{addr[0]} port {addr[1]}" for addr in getattr(exc, "errors", {}))
        return f"connection refused ({where or text}): is sshd running there?"
    if name == "CommandTimedOut":
        return f"a command did not finish within {timeout:g} s"
    if name == "SSHException" and ("banner" in text or "No existing session" in text):
        # paramiko reports a silent peer either way, depending on which thread notices first
        return f"ssh handshake did not complete within {timeout:g} s (is it sshd, and is it responding?)"
    if name == "SSHException":
        return f"ssh error: {text}"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}"
    return f"{name}: {text}" if text else name


class RemoteHosts:
    """Connections to every host; close() (or `with`) releases them."""

    def __init__(self, targets: list[str], ssh_config: str | None = None,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 command_timeout: float = DEFAULT_COMMAND_TIMEOUT) -> None:
        try:
            from fabric import Config, Connection
        except ImportError:
            raise SshError("launcher-config needs Fabric to reach hosts: pip install 'jacklring[launch]'") from None
        self.targets = list(targets)
        self.connect_timeout = connect_timeout
        self.command_timeout = command_timeout
        self.connections = []
        for target in self.targets:
            t = parse_ssh_target(target)
            # a Config of its own: commands run in parallel threads, and invoke rebuilds a
            # Config's data in place while merging, so a shared one can be seen half-built
            config = Config(runtime_ssh_path=ssh_config) if ssh_config else Config()
            # paramiko waits 15 s for the banner and 30 s for auth by default: bound them too, so
            # a host that accepts TCP and then stays silent fails within the connect deadline.
            kwargs = dict(config.connect_kwargs, banner_timeout=connect_timeout, auth_timeout=connect_timeout)
            self.connections.append(Connection(t.host, user=t.user, port=t.port, config=config,
                                               connect_timeout=connect_timeout, connect_kwargs=kwargs))

    def __enter__(self) -> "RemoteHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for conn in self.connections:
            try:
                conn.close()
            except Exception:  # closing a half-open connection must not hide the real error
                pass

    def _run_one(self, index: int, command: str, what: str | None = None) -> Outcome:
        target = self.targets[index]
        try:
            result = self.connections[index].run(command, hide=True, warn=True, in_stream=False,
                                                 timeout=self.command_timeout)
        except Exception as exc:  # every failure becomes a line in the report, never a traceback
            return Outcome(target, error=describe_error(exc, target, self.command_timeout
                                                        if type(exc).__name__ == "CommandTimedOut"
                                                        else self.connect_timeout))
        if result.exited != 0:
            detail = (result.stderr.strip().splitlines() or [""])[-1]
            what = what or f"`{command.split()[0]}`"
            return Outcome(target, stdout=result.stdout,
                           error=f"{what} exited with {result.exited}" + (f": {detail}" if detail else ""))
        return Outcome(target, stdout=result.stdout)

    def run_each(self, command_for: Callable[[int], str | None], what: str | None = None) -> list[Outcome]:
        """Run command_for(i) on host i, all hosts at once; None skips a host (no error)."""
        outcomes: list[Outcome | None] = [None] * len(self.targets)
        pool = ThreadPoolExecutor(max_workers=max(1, len(self.targets)), thread_name_prefix="launcher-config")
        try:
            futures = {}
            for i in range(len(self.targets)):
                command = command_for(i)
                if command is None:
                    outcomes[i] = Outcome(self.targets[i])
                else:
                    futures[pool.submit(self._run_one, i, command, what)] = i
            # Each host has its own connect and command deadline; this one catches anything stuck
            # past both (a host that accepted TCP and then went silent during the handshake).
            done, _ = wait(futures, timeout=self.connect_timeout + self.command_timeout + 5)
            for future, i in futures.items():
                if future in done:
                    outcomes[i] = future.result()
                else:
                    outcomes[i] = Outcome(self.targets[i], error="no answer within "
                                          f"{self.connect_timeout + self.command_timeout:g} s")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return [o for o in outcomes if o is not None]

    def run_all(self, command: str) -> list[Outcome]:
        return self.run_each(lambda _i: command)

    def check_access(self) -> list[HostAccess]:
        """Reachability and passwordless sudo for every host, in one round trip each."""
        report = []
        for outcome in self.run_all(ACCESS_PROBE):
            if outcome.error and not outcome.stdout:
                report.append(HostAccess(outcome.target, error=outcome.error))
                continue
            try:
                report.append(HostAccess(outcome.target, access=parse_access(outcome.stdout)))
            except ProbeError as exc:
                report.append(HostAccess(outcome.target, error=str(exc)))
        return report

    def apply(self, commands: list[list[Command]], use_sudo: list[bool]) -> list[Outcome]:
        """Run each host's setup commands in order through `sudo -n`; stop a host at its first
        failing command (best-effort ones excepted) and say which one failed."""
        def script(i: int) -> str | None:
            if not commands[i]:
                return None
            prefix = "sudo -n " if use_sudo[i] else ""
            lines = []
            for cmd in commands[i]:
                text = prefix + shlex.join(cmd.argv)
                if cmd.may_fail:
                    lines.append(f"{{ {text} || true; }}")
                else:
                    lines.append(f"{{ {text} || {{ echo \"failed: {_escape(text)}\" >&2; exit 1; }}; }}")
            return " && ".join(lines)
        return self.run_each(script, what="link setup")


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace("`", "\\`")
