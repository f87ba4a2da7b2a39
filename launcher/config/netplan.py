"""The IP plan for point-to-point cables and the commands that apply it on each host.

Every cable gets its own tiny subnet (a /30: two usable addresses, one per end) carved in
order from a private block, so the two ends of a cable talk to each other and to nobody
else, and traffic to a neighbour leaves through that very cable. The plan is only ever
written into commands and hostfiles; this module contacts nothing.
"""
from __future__ import annotations

import ipaddress
import shlex
from dataclasses import dataclass

from .discovery import HostFacts
from .topology import Cable, Topology

DEFAULT_SUBNET = "10.99.0.0/16"
LINK_PREFIX = 30


class PlanError(ValueError):
    """The IP plan cannot be made (block too small, clash with an existing address)."""


@dataclass(frozen=True)
class LinkAddressing:
    cable: Cable
    network: ipaddress.IPv4Network
    a_address: ipaddress.IPv4Address
    b_address: ipaddress.IPv4Address

    def address_of(self, host: int) -> ipaddress.IPv4Address:
        return self.a_address if host == self.cable.a else self.b_address

    def peer_of(self, host: int) -> ipaddress.IPv4Address:
        return self.b_address if host == self.cable.a else self.a_address


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    may_fail: bool = False   # best effort: a failure is reported, setup goes on

    def shell(self, sudo: bool = True) -> str:
        text = ("sudo " if sudo else "") + shlex.join(self.argv)
        return text + " || true" if self.may_fail else text


@dataclass
class IpPlan:
    topology: Topology
    links: list[LinkAddressing]

    def for_cable(self, cable: Cable) -> LinkAddressing:
        for link in self.links:
            if link.cable == cable:
                return link
        raise KeyError(cable)

    def addresses_towards(self, host: int, peer: int) -> list[str]:
        """host's addresses on its cables to peer, in cable order (one per parallel connection)."""
        return [str(self.for_cable(c).address_of(host)) for c in self.topology.between(host, peer)]

    def of_host(self, host: int) -> list[LinkAddressing]:
        return [link for link in self.links if host in (link.cable.a, link.cable.b)]


def plan_addresses(topo: Topology, subnet: str = DEFAULT_SUBNET) -> IpPlan:
    """One /30 per cable, in cable order; the lower-indexed host gets the first address."""
    try:
        block = ipaddress.ip_network(subnet, strict=True)
    except ValueError as exc:
        raise PlanError(f"--subnet {subnet!r}: {exc}") from None
    if block.version != 4 or not block.is_private:
        raise PlanError(f"--subnet {subnet!r}: expected a private IPv4 block such as {DEFAULT_SUBNET}")
    if block.prefixlen > LINK_PREFIX:
        raise PlanError(f"--subnet {subnet!r} is smaller than one /{LINK_PREFIX}")
    capacity = 2 ** (LINK_PREFIX - block.prefixlen)
    if len(topo.cables) > capacity:
        raise PlanError(f"--subnet {subnet} holds {capacity} links of /{LINK_PREFIX} "
                        f"but there are {len(topo.cables)} cables")
    networks = block.subnets(new_prefix=LINK_PREFIX)
    links = []
    for cable in topo.cables:
        net = next(networks)
        first, second = list(net.hosts())
        links.append(LinkAddressing(cable, net, first, second))
    return IpPlan(topo, links)


def check_no_clash(plan: IpPlan, facts: list[HostFacts], subnet: str = DEFAULT_SUBNET) -> None:
    """Refuse a block that overlaps a network a host already uses (other than our own plan,
    so running the tool again after --auto-setup is fine)."""
    block = ipaddress.ip_network(subnet)
    planned = {(link.cable.iface_of(h), str(link.address_of(h)), h)
               for link in plan.links for h in (link.cable.a, link.cable.b)}
    for h, host in enumerate(facts):
        if host.ethernet_address:
            ip = ipaddress.ip_address(host.ethernet_address)
            if ip.version == 4 and ip in block:
                raise PlanError(f"{host.ssh}: its address {ip} lies inside the link block {subnet}; "
                                "choose another with --subnet")
        for iface in host.interfaces:
            if iface.loopback:
                continue
            for addr in iface.addresses:
                if addr.version != 4 or (iface.name, str(addr.ip), h) in planned:
                    continue
                if addr.network.overlaps(block):
                    raise PlanError(f"{host.ssh}: {iface.name} already has {addr} which overlaps the link "
                                    f"block {subnet}; choose another with --subnet")


def macos_commands(plan: IpPlan, host: int, facts: HostFacts) -> list[Command]:
    """Disable the Thunderbolt bridge (it would claim the ports), then one subnet per cable."""
    cmds = []
    bridge = facts.hardware_ports.get("Thunderbolt Bridge", "bridge0")
    if "Thunderbolt Bridge" in facts.hardware_ports:
        # networksetup keeps the bridge off across reboots; ifconfig takes it down now.
        cmds.append(Command(("networksetup", "-setnetworkserviceenabled", "Thunderbolt Bridge", "off"),
                            may_fail=True))
    cmds.append(Command(("ifconfig", bridge, "down"), may_fail=True))
    for link in plan.of_host(host):
        iface = link.cable.iface_of(host)
        cmds.append(Command(("ifconfig", iface, "inet", str(link.address_of(host)),
                             "netmask", str(link.network.netmask))))
        # Route the neighbour through this cable even if an older route points elsewhere.
        cmds.append(Command(("route", "-n", "change", "-host", str(link.peer_of(host)),
                             "-interface", iface), may_fail=True))
    return cmds


def linux_commands(plan: IpPlan, host: int) -> list[Command]:
    cmds = []
    for link in plan.of_host(host):
        iface = link.cable.iface_of(host)
        cmds.append(Command(("ip", "link", "set", "dev", iface, "up")))
        # `replace` makes a second run a no-op instead of an "address exists" error.
        cmds.append(Command(("ip", "addr", "replace", f"{link.address_of(host)}/{LINK_PREFIX}",
                             "dev", iface)))
    return cmds


def host_commands(plan: IpPlan, facts: list[HostFacts]) -> list[list[Command]]:
    """Per host (topology order), the commands that put its cables on the plan."""
    return [macos_commands(plan, h, f) if f.is_macos else linux_commands(plan, h)
            for h, f in enumerate(facts)]


def format_commands(hosts: list[str], commands: list[list[Command]], sudo: list[bool]) -> str:
    """The per-host blocks printed when --auto-setup is off."""
    blocks = []
    for name, cmds, use_sudo in zip(hosts, commands, sudo):
        if not cmds:
            continue
        title = f"Setup for {name}"
        blocks.append("\n".join([title, "=" * len(title), *(c.shell(use_sudo) for c in cmds)]))
    return "\n\n".join(blocks) + ("\n" if blocks else "")
