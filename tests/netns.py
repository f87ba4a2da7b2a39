"""Two fresh network namespaces joined by a veth pair, for tests whose processes must talk over
a real network link rather than loopback. Needs root (CAP_NET_ADMIN) and iproute2; the
namespaces (and with them the veth ends) are removed on every exit, failures included."""
from __future__ import annotations

import os
import random
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class VethPair:
    names: tuple[str, str]       # the namespaces
    links: tuple[str, str]       # the veth end inside each
    addresses: tuple[str, str]   # the IPv4 address of each end (a /30 of its own)

    def exec_prefix(self, side: int) -> list[str]:
        """The command prefix that runs a program inside namespace `side`."""
        return ["ip", "netns", "exec", self.names[side]]


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


@contextmanager
def veth_pair(prefix: str = "10.200") -> Iterator[VethPair]:
    """Namespaces A and B with PREFIX.X.1/30 in A and PREFIX.X.2/30 in B (X random, so parallel
    runs do not collide). Raises RuntimeError(reason) when `ip netns add` is refused."""
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    names = (f"jks{tag}a", f"jks{tag}b")
    links = (f"jkw{tag}a", f"jkw{tag}b")
    subnet = random.randrange(256)
    addresses = (f"{prefix}.{subnet}.1", f"{prefix}.{subnet}.2")
    created = []
    try:
        for ns in names:
            made = _ip("netns", "add", ns, check=False)
            if made.returncode != 0:
                raise RuntimeError(f"`ip netns add` is not permitted here: {made.stderr.strip()}")
            created.append(ns)
        _ip("link", "add", links[0], "netns", names[0], "type", "veth", "peer", "name", links[1], "netns", names[1])
        for ns, link, addr in zip(names, links, addresses):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", link)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", link, "up")
        yield VethPair(names, links, addresses)
    finally:
        for ns in created:
            _ip("netns", "del", ns, check=False)  # deleting a namespace deletes its veth end
