"""Shaped links between network namespaces: one namespace per rank, a bridge namespace between.

Each rank's namespace has one interface, eth0, at SUBNET.(rank + 1)/24, whose veth peer is a port of
the bridge br0 in the bridge namespace (a switch; nothing is created or addressed in the caller's
namespace). Both ends of every veth get a tbf qdisc at the link rate, so each rank has a full-duplex
link of that rate in each direction, as a host's NIC on a switch does.

tbf drops any packet larger than its burst, and TCP hands the veth super-packets (GSO) of up to
64 KiB: tbf then splits them into segments and a 1 Gbit/s link runs near half its rate. So the
burst is at least 256 us of the rate and gso_max_size / gro_max_size just under it. The queue
holds 4 MiB (at least 10 ms of the rate): TCP small queues let one socket put up to
tcp_limit_output_bytes (4 MiB by default on recent kernels) into the qdisc, and a shorter tbf queue
drops those bytes on the sending host itself, where a real host's default qdisc would not.

Namespaces are named PREFIX-<pid>-<role>: cleanup_leftovers() removes those whose creating process
is gone (a run killed with SIGKILL leaves them; deleting a namespace deletes its veths too).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field

PREFIX = "jlnb"
MTU = 1500
_NAME = re.compile(rf"^{PREFIX}-(\d+)-")


def ip(*words: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *words], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise RuntimeError(f"netns: `ip {' '.join(words)}` failed: {done.stderr.strip()}")
    return done


def tc(namespace: str, *words: str) -> None:
    done = subprocess.run(["tc", "-n", namespace, *words], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"netns: `tc -n {namespace} {' '.join(words)}` failed: {done.stderr.strip()}")


def namespaces() -> list[str]:
    """Every named network namespace on this machine."""
    return [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]


def remove_namespace(name: str) -> None:
    """Kill what still runs inside (started by a run of this benchmark), then delete it."""
    pids = ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    deadline = time.monotonic() + 5
    while pids and ip("netns", "pids", name, check=False).stdout.split() and time.monotonic() < deadline:
        time.sleep(0.05)
    ip("netns", "del", name, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_leftovers(everything: bool = False) -> list[str]:
    """Remove this benchmark's namespaces whose creating process no longer runs (all of them
    with everything=True); returns their names."""
    gone = []
    for name in namespaces():
        match = _NAME.match(name)
        if match and (everything or not _alive(int(match.group(1)))):
            remove_namespace(name)
            gone.append(name)
    return gone


def burst_bytes(rate_bit: float) -> int:
    """tbf's bucket: 256 us of the rate, and always room for a few full-size frames."""
    return max(int(rate_bit / 8 * 256e-6) + 1, 4 * (MTU + 14))


@dataclass
class Links:
    """n ranks behind shaped links; create() builds them, destroy() removes every trace."""
    ranks: int
    rate_bit: float
    subnet: str = "10.211.0"
    queue_bytes: int = 4 << 20
    prefix: str = field(default_factory=lambda: f"{PREFIX}-{os.getpid()}")
    created: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}-r{rank}"

    def address(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

    def exec_prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(rank)]

    def limit(self) -> int:
        """tbf's queue in bytes: queue_bytes, but at least 10 ms of the rate and two bursts."""
        return max(self.queue_bytes, int(self.rate_bit / 8 * 0.010), 2 * burst_bytes(self.rate_bit))

    def create(self) -> None:
        burst = burst_bytes(self.rate_bit)
        gso = burst - MTU  # a whole super-packet (plus its headers) always fits in the bucket
        shape = ["root", "tbf", "rate", f"{int(self.rate_bit)}bit", "burst", str(burst), "limit", str(self.limit())]
        self._add_namespace(self.bridge)
        ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        ip("-n", self.bridge, "link", "set", "br0", "up")
        for r in range(self.ranks):
            ns, port = self.namespace(r), f"p{r}"
            self._add_namespace(ns)
            ip("-n", self.bridge, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            for where, dev in ((self.bridge, port), (ns, "eth0")):
                ip("-n", where, "link", "set", dev, "gso_max_size", str(gso), "gro_max_size", str(gso))
                tc(where, "qdisc", "add", "dev", dev, *shape)
            ip("-n", self.bridge, "link", "set", port, "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self.created.append(name)

    def destroy(self) -> None:
        # Rank namespaces first: their processes hold sockets; the bridge goes last.
        for name in reversed(self.created):
            remove_namespace(name)
        self.created.clear()

    def leftovers(self) -> list[str]:
        """This run's namespaces that still exist (none after destroy())."""
        return [name for name in namespaces() if name.startswith(self.prefix + "-")]
