"""Free TCP ports for a job that starts soon, chosen below the kernel's ephemeral range.

A port taken with bind(port 0) comes from the ephemeral range, the same range the kernel hands
out as the source port of every outgoing connection. Between choosing the port and the rank
binding it, any connection on the machine may take it as its source port; and a client that
keeps retrying a connect to a local port in that range can even connect to itself (TCP's
simultaneous open), so the rank that should listen there gets EADDRINUSE. Ports below the
range are never handed out that way, so a port found free there stays free unless a program
binds it on purpose.

A port counts as free only when it is free on every address of the host: the probe binds the
wildcard address. A port free on 127.0.0.1 but held on 127.0.0.2 (another job's listener) is
not free for a server that binds all addresses, as torch's TCPStore does.

JACKLRING_LOCAL_PORTS=LOW-HIGH draws from that range instead (a firewall's opening, or one slice
per test process when several run jobs side by side).
"""
from __future__ import annotations

import os
import random
import socket
from contextlib import ExitStack

LOWEST = 10000  # below this lie the well-known and registered ports services bind on purpose
ATTEMPTS = 200


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux); (32768, 60999), Linux's default, where unknown."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def port_range(raw: str) -> tuple[int, int]:
    """JACKLRING_LOCAL_PORTS's value, "LOW-HIGH" (both included), as (LOW, HIGH + 1)."""
    try:
        low, high = (int(part) for part in raw.split("-"))
    except ValueError:
        raise ValueError("is not a port range LOW-HIGH (e.g. 20000-20999)") from None
    if not 1 <= low <= high <= 65535:
        raise ValueError("must be LOW-HIGH with 1 <= LOW <= HIGH <= 65535")
    return low, high + 1


def free_ports(hosts: list[str]) -> list[int]:
    """One free TCP port per host, all distinct: from JACKLRING_LOCAL_PORTS when set, else below
    the ephemeral range when that range leaves room (else from the kernel, bind port 0). Each
    port was bound on all of this host's addresses and released: it is free now. For another
    host's address this is the best guess there is."""
    raw = os.environ.get("JACKLRING_LOCAL_PORTS", "").strip()
    if raw:
        try:
            span = port_range(raw)
        except ValueError as exc:
            raise ValueError(f"JACKLRING_LOCAL_PORTS={raw!r} {exc}") from None
    else:
        span = (LOWEST, ephemeral_range()[0])
    with ExitStack() as stack:
        ports: list[int] = []
        for host in hosts:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            ports.append(_bind_some_port(sock, _wildcard(family), span, set(ports), bool(raw)))
        return ports


def _wildcard(family: socket.AddressFamily) -> str:
    """The address that is every address of the host: a bind there fails while any address
    holds the port (IPv6's also covers IPv4 on a dual-stack host)."""
    return "::" if family == socket.AF_INET6 else "0.0.0.0"


def _bind_some_port(sock: socket.socket, host: str, span: tuple[int, int], taken: set[int], only: bool) -> int:
    """A port of span bound on sock; outside it (the kernel's choice) only when not `only` and
    span is too small to find one in."""
    low, high = span
    if only or high - low >= 1000:
        for _ in range(ATTEMPTS):
            port = random.randrange(low, high)
            if port in taken:
                continue
            try:
                sock.bind((host, port))
                return port
            except OSError:
                continue
        if only:
            raise OSError(f"no free port found in JACKLRING_LOCAL_PORTS={low}-{high - 1} "
                          f"after {ATTEMPTS} tries")
    sock.bind((host, 0))
    return sock.getsockname()[1]
