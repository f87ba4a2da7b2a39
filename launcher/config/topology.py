"""The cable graph between hosts, and the shapes the backends need from it.

jaccl needs a full mesh (a cable between every pair of hosts); ring and jaccl-ring need a
ring through every host. Several cables between two neighbours give several parallel
connections, so the ring we pick is the one whose thinnest link has the most cables.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

from .discovery import HostFacts

# The exhaustive ring search is exponential in the host count; Thunderbolt clusters are small.
MAX_RING_SEARCH_HOSTS = 16


class TopologyError(ValueError):
    """The cables do not form what the backend needs; the message names what is missing."""


@dataclass(frozen=True)
class Cable:
    """One cable: host index a's interface a_iface to host index b's b_iface (a < b)."""

    a: int
    a_iface: str
    b: int
    b_iface: str

    def iface_of(self, host: int) -> str:
        return self.a_iface if host == self.a else self.b_iface

    def other(self, host: int) -> int:
        return self.b if host == self.a else self.a


@dataclass
class Topology:
    hosts: list[str]
    cables: list[Cable]
    warnings: list[str]

    def __post_init__(self) -> None:
        self.cables = sorted(self.cables, key=lambda c: (c.a, c.b, c.a_iface, c.b_iface))

    @property
    def size(self) -> int:
        return len(self.hosts)

    def between(self, i: int, j: int) -> list[Cable]:
        lo, hi = min(i, j), max(i, j)
        return [c for c in self.cables if c.a == lo and c.b == hi]

    def matrix(self) -> list[list[int]]:
        """Cable counts: matrix[i][j] = number of cables between host i and host j."""
        counts = [[0] * self.size for _ in range(self.size)]
        for c in self.cables:
            counts[c.a][c.b] += 1
            counts[c.b][c.a] += 1
        return counts

    def missing_pairs(self) -> list[tuple[str, str]]:
        counts = self.matrix()
        return [(self.hosts[i], self.hosts[j]) for i, j in combinations(range(self.size), 2) if counts[i][j] == 0]


def from_thunderbolt(facts: list[HostFacts]) -> Topology:
    """Match every port's peer UUID to the port that owns it; one Cable per matched pair."""
    owner: dict[str, tuple[int, int]] = {}
    for h, host in enumerate(facts):
        for p, port in enumerate(host.thunderbolt):
            owner[port.uuid] = (h, p)
    warnings: list[str] = []
    seen: set[frozenset[str]] = set()
    cables = []
    for h, host in enumerate(facts):
        for port in host.thunderbolt:
            if not port.peer_uuid:
                continue
            if port.peer_uuid not in owner:
                who = f" ({port.peer_name})" if port.peer_name else ""
                warnings.append(f"{host.ssh}: Thunderbolt {port.receptacle} is cabled to a machine "
                                f"outside the host list{who}; ignored")
                continue
            key = frozenset((port.uuid, port.peer_uuid))
            if key in seen:
                continue
            seen.add(key)
            peer_h, peer_p = owner[port.peer_uuid]
            peer_port = facts[peer_h].thunderbolt[peer_p]
            if peer_h == h:
                warnings.append(f"{host.ssh}: a cable loops from Thunderbolt {port.receptacle} back to "
                                f"Thunderbolt {peer_port.receptacle} of the same host; ignored")
                continue
            missing = [f"{facts[x].ssh} Thunderbolt {pt.receptacle}"
                       for x, pt in ((h, port), (peer_h, peer_port)) if not pt.iface]
            if missing:
                warnings.append(f"no network interface for {', '.join(missing)} (is Thunderbolt "
                                "networking enabled?); that cable is ignored")
                continue
            ends = sorted([(h, port.iface), (peer_h, peer_port.iface)])
            cables.append(Cable(ends[0][0], ends[0][1], ends[1][0], ends[1][1]))
    return Topology([f.ssh for f in facts], cables, warnings)


def is_full_mesh(topo: Topology) -> bool:
    return topo.size >= 1 and not topo.missing_pairs()


def mesh_connections(topo: Topology) -> int:
    """Cables every pair can use in parallel (the thinnest pair); 0 when the mesh is broken."""
    counts = topo.matrix()
    pairs = [counts[i][j] for i, j in combinations(range(topo.size), 2)]
    return min(pairs) if pairs else 1


def _hamiltonian_cycle(counts: list[list[int]], threshold: int) -> list[int] | None:
    """First cycle (in lexicographic order from host 0) through all hosts using only links
    with at least `threshold` cables; None if there is none."""
    n = len(counts)
    if n == 1:
        return [0]
    if n == 2:
        return [0, 1] if counts[0][1] >= threshold else None
    full = (1 << n) - 1
    dead: set[tuple[int, int]] = set()   # (visited mask, last host) known to lead nowhere
    path = [0]

    def extend(mask: int, last: int) -> bool:
        if mask == full:
            return counts[last][0] >= threshold
        if (mask, last) in dead:
            return False
        for nxt in range(1, n):
            if not mask & (1 << nxt) and counts[last][nxt] >= threshold:
                path.append(nxt)
                if extend(mask | (1 << nxt), nxt):
                    return True
                path.pop()
        dead.add((mask, last))
        return False

    return path if extend(1, 0) else None


def find_ring(topo: Topology) -> tuple[list[int], int] | None:
    """The ring through every host whose thinnest link has the most cables.

    Returns (host order starting at host 0, cables per link) or None. Two hosts form a ring
    with a single cable (left and right neighbour are the same host).
    """
    n = topo.size
    if n > MAX_RING_SEARCH_HOSTS:
        raise TopologyError(f"{n} hosts are too many for the exhaustive ring search "
                            f"(at most {MAX_RING_SEARCH_HOSTS})")
    if n == 1:
        return [0], 1
    counts = topo.matrix()
    for threshold in range(max(max(row) for row in counts), 0, -1):
        order = _hamiltonian_cycle(counts, threshold)
        if order is not None:
            return order, threshold
    return None


def longest_partial_ring(topo: Topology) -> list[int]:
    """The longest cycle (>= 3 hosts) among the hosts, for telling the user what does work."""
    counts = topo.matrix()
    n = topo.size
    best: list[int] = []
    if n > 10:
        return best

    def walk(path: list[int], visited: int) -> None:
        nonlocal best
        last = path[-1]
        if len(path) >= 3 and counts[last][path[0]] and len(path) > len(best):
            best = list(path)
        for nxt in range(path[0] + 1, n):  # the smallest host of a cycle starts it: no repeats
            if not visited & (1 << nxt) and counts[last][nxt]:
                path.append(nxt)
                walk(path, visited | (1 << nxt))
                path.pop()

    for start in range(n):
        walk([start], 1 << start)
    return best


def explain_no_mesh(topo: Topology) -> str:
    pairs = topo.missing_pairs()
    listed = ", ".join(f"{a} - {b}" for a, b in pairs)
    return f"not a full mesh: no cable between {listed}"


def explain_no_ring(topo: Topology) -> str:
    counts = topo.matrix()
    parts = []
    if topo.size == 2:
        parts.append(f"no cable between {topo.hosts[0]} and {topo.hosts[1]}")
    else:
        for i, name in enumerate(topo.hosts):
            neighbours = [topo.hosts[j] for j in range(topo.size) if j != i and counts[i][j]]
            if len(neighbours) < 2:
                has = ", ".join(neighbours) if neighbours else "nobody"
                parts.append(f"{name} is cabled to {has} (a ring needs two neighbours)")
        partial = longest_partial_ring(topo)
        if partial:
            parts.append("the longest ring covers only " + " -> ".join(topo.hosts[i] for i in partial))
        if not parts:
            parts.append("every host has two neighbours but no single ring passes through all of them")
    return "no ring through every host: " + "; ".join(parts)

