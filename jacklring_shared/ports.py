"""Free TCP ports for a job that starts soon, chosen below the kernel's ephemeral range.

A port taken with bind(port 0) comes from the ephemeral range, the same range the kernel hands
out as the source port of every outgoing connection. Between choosing the port and the rank
binding it, any connection on the machine may take it as its source port; and a client that
keeps retrying a connect to a local port in that range can even connect to itself (TCP's
simultaneous open), so the rank that should listen there gets EADDRINUSE. Ports below the
range are never handed out that way, so a port found free there stays free unless a program
binds it on purpose.
"""
from __future__ import annotations

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


def free_ports(hosts: list[str]) -> list[int]:
    """One free TCP port per host, all distinct, below the ephemeral range when that range leaves
    room (else from the kernel, bind port 0). Each port was bound and released: it is free now."""
    low, _ = ephemeral_range()
    with ExitStack() as stack:
        ports: list[int] = []
        for host in hosts:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            ports.append(_bind_some_port(sock, host, low, set(ports)))
        return ports


def _bind_some_port(sock: socket.socket, host: str, ephemeral_low: int, taken: set[int]) -> int:
    if ephemeral_low - LOWEST >= 1000:
        for _ in range(ATTEMPTS):
            port = random.randrange(LOWEST, ephemeral_low)
            if port in taken:
                continue
            try:
                sock.bind((host, port))
                return port
            except OSError:
                continue
    try:
        sock.bind((host, 0))
    except OSError:
        sock.bind(("", 0))  # an address not on this machine: any free port is the best guess
    return sock.getsockname()[1]
