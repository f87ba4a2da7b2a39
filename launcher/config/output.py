"""What launcher-config produces: Graphviz DOT of the cables and the launcher hostfile.

Hostfiles are built as launcher.hostfile.Hostfile objects and validated by the launcher's
own parser before they are written, so what we write is what `launcher` accepts.
"""
from __future__ import annotations

from ..hostfile import Host, Hostfile, check_backend, dump_hostfile, parse_hostfile
from .discovery import HostFacts
from .netplan import IpPlan
from .topology import Topology


class OutputError(ValueError):
    """A hostfile cannot be made for this backend; the message names the host and why."""


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(topo: Topology, plan: IpPlan | None = None) -> str:
    """An undirected graph: one node per host, one edge per cable "ifaceA / ifaceB"."""
    lines = ["graph topology {", "  node [shape=box];"]
    for i, name in enumerate(topo.hosts):
        lines.append(f"  h{i} [label={_dot_quote(name)}];")
    for cable in topo.cables:
        label = _dot_quote(f"{cable.a_iface} / {cable.b_iface}")
        if plan is not None:  # a second label line (DOT's \n escape) with the link's subnet
            label = label[:-1] + "\\n" + str(plan.for_cable(cable).network) + '"'
        lines.append(f"  h{cable.a} -- h{cable.b} [label={label}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _validated(hostfile: Hostfile) -> Hostfile:
    # Round-trip through the launcher's parser: any shape it would reject fails here, loudly.
    parsed = parse_hostfile(dump_hostfile(hostfile), source="generated hostfile")
    check_backend(parsed, hostfile.backend, source="generated hostfile")
    return parsed


def _rdma_device(facts: HostFacts, iface: str) -> str:
    dev = facts.rdma_for_iface(iface)
    if dev is None:
        raise OutputError(f"{facts.ssh}: no RDMA device on {iface} (ibv_devices lists "
                          f"{', '.join(sorted(facts.rdma_names())) or 'none'}); "
                          "enable RDMA (rdma_ctl enable in recovery) or use --backend ring")
    return dev


def _cell(devices: list[str]):
    return devices[0] if len(devices) == 1 else devices


def _require_ethernet(facts: HostFacts, role: str) -> str:
    if not facts.ethernet_address:
        raise OutputError(f"{facts.ssh}: could not find its ethernet address ({role})")
    return facts.ethernet_address


def ring_hostfile(topo: Topology, plan: IpPlan, order: list[int], connections: int,
                  envs: list[str]) -> Hostfile:
    """Rank r = order[r]; its ips are its ends of the cables to its left neighbour, which
    connects to them (the ring backend: rank r connects right, accepts from the left)."""
    hosts = []
    for rank, node in enumerate(order):
        left = order[rank - 1]
        ips = plan.addresses_towards(node, left)[:connections]
        hosts.append(Host(ssh=topo.hosts[node], ips=ips, rdma=[]))
    return _validated(Hostfile(hosts=hosts, backend="ring", envs=list(envs)))


def jaccl_hostfile(topo: Topology, facts: list[HostFacts], connections: int,
                   envs: list[str]) -> Hostfile:
    """Full mesh: rdma[i][j] = host i's RDMA device(s) on its cable(s) to host j."""
    hosts = []
    for i, f in enumerate(facts):
        row = []
        for j in range(topo.size):
            if i == j:
                row.append(None)
                continue
            cables = topo.between(i, j)[:connections]
            row.append(_cell([_rdma_device(f, c.iface_of(i)) for c in cables]))
        ips = [_require_ethernet(f, "rank 0 coordinator address")] if i == 0 else \
            ([f.ethernet_address] if f.ethernet_address else [])
        hosts.append(Host(ssh=f.ssh, ips=ips, rdma=row))
    return _validated(Hostfile(hosts=hosts, backend="jaccl", envs=list(envs)))


def jaccl_ring_hostfile(topo: Topology, facts: list[HostFacts], order: list[int], connections: int,
                        envs: list[str]) -> Hostfile:
    """Ring order; each rank has RDMA devices toward its two neighbours only."""
    n = len(order)
    hosts = []
    for rank, node in enumerate(order):
        neighbours = {order[rank - 1], order[(rank + 1) % n]}
        row = []
        for other in order:
            if other == node or other not in neighbours:
                row.append(None)
                continue
            cables = topo.between(node, other)[:connections]
            row.append(_cell([_rdma_device(facts[node], c.iface_of(node)) for c in cables]))
        f = facts[node]
        ips = [_require_ethernet(f, "rank 0 coordinator address")] if rank == 0 else \
            ([f.ethernet_address] if f.ethernet_address else [])
        hosts.append(Host(ssh=f.ssh, ips=ips, rdma=row))
    return _validated(Hostfile(hosts=hosts, backend="jaccl-ring", envs=list(envs)))


def lan_rdma_device(facts: HostFacts) -> str | None:
    """On a switched LAN, the RDMA device on the interface carrying the ethernet address
    (else the first active one): every peer is reached through it."""
    for iface in facts.interfaces:
        if any(str(a.ip) == facts.ethernet_address for a in iface.addresses):
            dev = facts.rdma_for_iface(iface.name)
            if dev:
                return dev
    active = [d.name for d in facts.rdma if d.active is not False]
    return active[0] if active else None


def ethernet_hostfile(facts: list[HostFacts], backend: str, envs: list[str]) -> Hostfile:
    """Hosts on one LAN (a switch): every pair is connected, rank order = host order."""
    n = len(facts)
    hosts = []
    for i, f in enumerate(facts):
        ip = _require_ethernet(f, "needed in the hostfile")
        rdma: list = []
        if backend in ("jaccl", "jaccl-ring"):
            dev = lan_rdma_device(f)
            if dev is None:
                raise OutputError(f"{f.ssh}: no RDMA device found (checked /sys/class/infiniband and "
                                  "ibv_devices); use --backend ring")
            neighbours = set(range(n)) - {i} if backend == "jaccl" else {(i - 1) % n, (i + 1) % n} - {i}
            rdma = [dev if j in neighbours else None for j in range(n)]
        hosts.append(Host(ssh=f.ssh, ips=[ip], rdma=rdma))
    return _validated(Hostfile(hosts=hosts, backend=backend, envs=list(envs)))
