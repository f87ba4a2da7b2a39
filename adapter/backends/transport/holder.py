"""Who holds a TCP port on this host: the uid (and, where /proc lets this process see it, the
pid) of the listening socket, read from /proc/net/tcp and /proc/PID/fd (Linux). Used to name a
squatter when an address the job needs is taken (a grow's coordinator or slot address) instead
of blaming a rank, and to keep a newcomer from handing its proof to another user's listener."""
from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

LISTEN_STATE = "0A"


@dataclass(frozen=True)
class Holder:
    uid: int
    pid: int | None
    program: str | None

    def describe(self) -> str:
        try:
            import pwd
            user = f" ({pwd.getpwuid(self.uid).pw_name})"
        except (ImportError, KeyError):
            user = ""
        mine = "this user" if self.uid == os.getuid() else "another user"
        proc = f", pid {self.pid}{f' ({self.program})' if self.program else ''}" if self.pid is not None else \
            ", pid not visible to this user"
        return f"held by uid {self.uid}{user}{proc}: a process of {mine}"


def _ip_of(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # each 32-bit word is host-order
    return socket.inet_ntop(socket.AF_INET6, words)


def _listening(host: str, port: int) -> list[tuple[int, int]]:
    """(uid, inode) of the listening sockets that cover host:port."""
    try:
        wanted = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return []
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != LISTEN_STATE:
                continue
            addr, _, hex_port = fields[1].partition(":")
            if int(hex_port, 16) != port:
                continue
            ip = ipaddress.ip_address(_ip_of(addr))
            mapped = getattr(ip, "ipv4_mapped", None)
            if ip.is_unspecified or ip == wanted or mapped == wanted:
                found.append((int(fields[7]), int(fields[9])))
    return found


def _pid_of(inode: int) -> tuple[int | None, str | None]:
    target = f"socket:[{inode}]"
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                if os.readlink(fd.path) == target:
                    with open(f"/proc/{entry.name}/comm") as f:
                        return int(entry.name), f.read().strip()
        except OSError:
            continue  # gone, or another user's (not visible): the uid alone is named
    return None, None


def holder(host: str, port: int) -> Holder | None:
    """Who listens at host:port on this host, or None when nobody does (or it is not known)."""
    sockets = _listening(host, port)
    if not sockets:
        return None
    uid, inode = sockets[0]
    pid, program = _pid_of(inode)
    return Holder(uid, pid, program)


def describe(host: str, port: int) -> str:
    """'; held by uid ...' for an error message, or '' when nothing is known."""
    found = holder(host, port)
    return "" if found is None else f"; {found.describe()}"
