"""What each host reports about its network hardware, as pure functions over command output.

Nothing here talks to a host: `launcher.config.ssh` runs the probe scripts below over ssh
and hands their stdout to `parse_probe`, so every parser is testable with recorded output.

Thunderbolt cables are found the way the hardware identifies them: every Thunderbolt bus
(one per port) of a Mac has a domain UUID, and a bus with a machine at the other end lists
that machine's bus UUID among its `_items`. Host A port p and host B port q share a cable
when p's peer UUID is q's UUID. `networksetup -listallhardwareports` names the network
interface behind each port ("Thunderbolt 3" -> en4), and `ibv_devices` says whether that
interface has an RDMA device (macOS names it rdma_<iface>).
"""
from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field

SECTION_MARK = "@@jacklring "

# One ssh round trip per host for the access check: what system, who, where ssh came in, sudo.
ACCESS_PROBE = (
    f"echo '{SECTION_MARK}uname'; uname -s; "
    f"echo '{SECTION_MARK}uid'; id -u; "
    f"echo '{SECTION_MARK}ssh_connection'; echo \"$SSH_CONNECTION\"; "
    f"echo '{SECTION_MARK}sudo'; if sudo -n true >/dev/null 2>&1; then echo yes; else echo no; fi"
)

MACOS_PROBE = (
    f"echo '{SECTION_MARK}system_profiler'; system_profiler SPThunderboltDataType -json 2>/dev/null; "
    f"echo '{SECTION_MARK}hardware_ports'; networksetup -listallhardwareports 2>/dev/null; "
    f"echo '{SECTION_MARK}ibv_devices'; ibv_devices 2>/dev/null; "
    f"echo '{SECTION_MARK}ipconfig'; ipconfig getifaddr en0 2>/dev/null; ipconfig getifaddr en1 2>/dev/null; "
    "true"
)

# RDMA devices from sysfs (present even without rdma-core userspace): name|port 1 state|netdevs.
LINUX_PROBE = (
    f"echo '{SECTION_MARK}ip_addr'; ip -j addr 2>/dev/null; "
    f"echo '{SECTION_MARK}ip_link'; ip -j link 2>/dev/null; "
    f"echo '{SECTION_MARK}rdma'; "
    "for d in /sys/class/infiniband/*; do [ -d \"$d\" ] || continue; "
    "printf '%s|%s|' \"${d##*/}\" \"$(cat \"$d/ports/1/state\" 2>/dev/null)\"; "
    "for n in \"$d\"/device/net/*; do [ -e \"$n\" ] && printf '%s ' \"${n##*/}\"; done; echo; done; "
    f"echo '{SECTION_MARK}ibv_devices'; ibv_devices 2>/dev/null; "
    "true"
)


class ProbeError(ValueError):
    """A host's command output could not be understood; the message says which and why."""


@dataclass(frozen=True)
class ThunderboltPort:
    """One Thunderbolt bus (= one physical port) of a host."""

    receptacle: str          # "1", "2", ... as printed on the port map
    uuid: str                # this bus's domain UUID
    peer_uuid: str | None    # domain UUID of the machine's bus at the other end of the cable
    iface: str | None        # network interface carrying IP over this port (en2, ...)
    speed: str = ""          # "Up to 80 Gb/s"
    peer_name: str = ""      # the far end's device name, for messages


@dataclass(frozen=True)
class RdmaDevice:
    name: str
    netdevs: tuple[str, ...] = ()
    active: bool | None = None   # None: port state unknown (macOS, ibv_devices only)


@dataclass(frozen=True)
class Interface:
    name: str
    up: bool
    link_type: str
    mac: str
    addresses: tuple[ipaddress.IPv4Interface | ipaddress.IPv6Interface, ...] = ()

    @property
    def loopback(self) -> bool:
        return self.link_type == "loopback"


@dataclass
class HostFacts:
    """Everything discovery learned about one host, keyed by the name we ssh to."""

    ssh: str
    system: str = ""                      # "Darwin" or "Linux"
    ethernet_address: str | None = None
    thunderbolt: list[ThunderboltPort] = field(default_factory=list)
    hardware_ports: dict[str, str] = field(default_factory=dict)
    rdma: list[RdmaDevice] = field(default_factory=list)
    interfaces: list[Interface] = field(default_factory=list)

    @property
    def is_macos(self) -> bool:
        return self.system == "Darwin"

    def rdma_names(self) -> set[str]:
        return {d.name for d in self.rdma}

    def rdma_for_iface(self, iface: str) -> str | None:
        """The RDMA device that sits on a network interface, or None."""
        for dev in self.rdma:
            if iface in dev.netdevs:
                return dev.name
        # macOS names the device after the interface and ibv_devices does not list netdevs.
        name = f"rdma_{iface}"
        return name if name in self.rdma_names() else None


@dataclass(frozen=True)
class AccessInfo:
    system: str
    uid: int | None
    ssh_server_address: str | None
    has_sudo: bool

    @property
    def is_root(self) -> bool:
        return self.uid == 0


def split_sections(text: str) -> dict[str, str]:
    """Cut probe output at its section markers into {section name: body}."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(SECTION_MARK):
            current = sections.setdefault(line[len(SECTION_MARK):].strip(), [])
        elif current is not None:
            current.append(line)
    return {name: "\n".join(lines).strip("\n") for name, lines in sections.items()}


def parse_access(text: str) -> AccessInfo:
    sections = split_sections(text)
    if "uname" not in sections:
        raise ProbeError("the access probe printed nothing recognisable (is the login shell POSIX sh?)")
    uid_text = sections.get("uid", "").strip()
    return AccessInfo(
        system=sections["uname"].strip(),
        uid=int(uid_text) if uid_text.isdigit() else None,
        ssh_server_address=ssh_server_address(sections.get("ssh_connection", "")),
        has_sudo=sections.get("sudo", "").strip() == "yes",
    )


def ssh_server_address(ssh_connection: str) -> str | None:
    """The host's own address from $SSH_CONNECTION ("client cport server sport")."""
    fields = ssh_connection.split()
    if len(fields) != 4:
        return None
    try:
        addr = ipaddress.ip_address(fields[2].split("%")[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return str(addr)


def parse_hardware_ports(text: str) -> dict[str, str]:
    """`networksetup -listallhardwareports` -> {"Thunderbolt 1": "en2", "Wi-Fi": "en0", ...}."""
    ports: dict[str, str] = {}
    port: str | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("Hardware Port:"):
            port = line.partition(":")[2].strip()
        elif line.startswith("Device:") and port is not None:
            ports[port] = line.partition(":")[2].strip()
            port = None
    return ports


def parse_ibv_devices(text: str) -> list[RdmaDevice]:
    """`ibv_devices` table (header, dashes, then "name guid" rows) -> devices."""
    devices = []
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0] in ("device", "------") or set(fields[0]) == {"-"}:
            continue
        devices.append(RdmaDevice(fields[0]))
    return devices


def parse_sysfs_rdma(text: str) -> list[RdmaDevice]:
    """Lines "name|port state|netdev netdev" printed by LINUX_PROBE from /sys/class/infiniband."""
    devices = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) != 3:
            raise ProbeError(f"unexpected RDMA line {line!r}")
        name, state, netdevs = parts
        active = None if not state.strip() else "ACTIVE" in state.upper()
        devices.append(RdmaDevice(name.strip(), tuple(netdevs.split()), active))
    return devices


def _receptacle_id(bus: dict) -> str | None:
    # The port number sits in "receptacle_<n>_tag" (n is 1 on current Macs; scan to be safe).
    for key, value in bus.items():
        if key.startswith("receptacle_") and key.endswith("_tag") and isinstance(value, dict):
            rid = value.get("receptacle_id_key")
            if rid is not None:
                return str(rid)
    return None


def _receptacle_speed(bus: dict) -> str:
    for key, value in bus.items():
        if key.startswith("receptacle_") and key.endswith("_tag") and isinstance(value, dict):
            return str(value.get("current_speed_key", ""))
    return ""


def parse_thunderbolt(text: str, hardware_ports: dict[str, str]) -> list[ThunderboltPort]:
    """`system_profiler SPThunderboltDataType -json` -> one ThunderboltPort per bus with a UUID.

    The peer is the first attached item that has its own domain UUID (another computer);
    docks and displays have none and do not count as cables between hosts.
    """
    try:
        data = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ProbeError(f"system_profiler printed invalid JSON ({exc.msg} at line {exc.lineno})") from None
    buses = data.get("SPThunderboltDataType", []) if isinstance(data, dict) else []
    ports = []
    for bus in buses:
        uuid = bus.get("domain_uuid_key")
        receptacle = _receptacle_id(bus)
        if not uuid or receptacle is None:
            continue
        peers = [item for item in bus.get("_items", []) if item.get("domain_uuid_key")]
        peer = peers[0] if peers else None
        ports.append(ThunderboltPort(
            receptacle=receptacle,
            uuid=uuid,
            peer_uuid=peer["domain_uuid_key"] if peer else None,
            iface=hardware_ports.get(f"Thunderbolt {receptacle}"),
            speed=_receptacle_speed(bus),
            peer_name=(peer.get("device_name_key") or peer.get("_name", "")) if peer else "",
        ))
    return sorted(ports, key=lambda p: (len(p.receptacle), p.receptacle))


def parse_ip_json(text: str, what: str) -> list[dict]:
    try:
        data = json.loads(text) if text.strip() else []
    except json.JSONDecodeError as exc:
        raise ProbeError(f"`{what}` printed invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, list):
        raise ProbeError(f"`{what}` printed JSON that is not a list of interfaces")
    return data


def parse_ip_addr(addr_text: str, link_text: str = "") -> list[Interface]:
    """`ip -j addr` (+ optional `ip -j link` for state) -> interfaces with their addresses."""
    links = {entry.get("ifname"): entry for entry in parse_ip_json(link_text, "ip -j link")}
    interfaces = []
    for entry in parse_ip_json(addr_text, "ip -j addr"):
        name = entry.get("ifname", "")
        link = {**entry, **links.get(name, {})}
        flags = link.get("flags", [])
        addresses = []
        for info in entry.get("addr_info", []):
            if info.get("family") not in ("inet", "inet6") or "local" not in info:
                continue
            addresses.append(ipaddress.ip_interface(f"{info['local']}/{info.get('prefixlen', 32)}"))
        interfaces.append(Interface(
            name=name,
            up="UP" in flags and link.get("operstate", "UNKNOWN") in ("UP", "UNKNOWN"),
            link_type=link.get("link_type", ""),
            mac=link.get("address", ""),
            addresses=tuple(addresses),
        ))
    return interfaces


def first_global_ipv4(interfaces: list[Interface]) -> str | None:
    for iface in interfaces:
        if not iface.up or iface.loopback:
            continue
        for addr in iface.addresses:
            if addr.version == 4 and not addr.ip.is_link_local:
                return str(addr.ip)
    return None


def choose_ethernet_address(ssh_target: str, access: AccessInfo, interfaces: list[Interface],
                            ipconfig: str = "") -> str | None:
    """The address other hosts should use to reach this one over the LAN.

    The address sshd saw our connection arrive on comes first: the hosts share a LAN with
    this machine, so the address that reached it is one the other hosts can reach too (and on
    loopback test hosts it is 127.0.0.2, 127.0.0.3, ... although `lo` only lists 127.0.0.1/8).
    Then the ssh target if it is an IP, then the first global IPv4 of an up interface (Linux)
    or of en0/en1 (macOS).
    """
    if access.ssh_server_address:
        return access.ssh_server_address
    try:
        return str(ipaddress.ip_address(ssh_target))
    except ValueError:
        pass
    found = first_global_ipv4(interfaces)
    if found:
        return found
    for line in ipconfig.splitlines():
        if line.strip():
            return line.strip()
    return None


def parse_probe(ssh: str, access: AccessInfo, text: str) -> HostFacts:
    """Turn one host's MACOS_PROBE or LINUX_PROBE output into HostFacts."""
    sections = split_sections(text)
    facts = HostFacts(ssh=ssh, system=access.system)
    try:
        if access.system == "Darwin":
            facts.hardware_ports = parse_hardware_ports(sections.get("hardware_ports", ""))
            facts.thunderbolt = parse_thunderbolt(sections.get("system_profiler", ""), facts.hardware_ports)
            facts.rdma = parse_ibv_devices(sections.get("ibv_devices", ""))
        else:
            facts.interfaces = parse_ip_addr(sections.get("ip_addr", ""), sections.get("ip_link", ""))
            facts.rdma = parse_sysfs_rdma(sections.get("rdma", ""))
            if not facts.rdma:
                facts.rdma = parse_ibv_devices(sections.get("ibv_devices", ""))
    except ProbeError as exc:
        raise ProbeError(f"{ssh}: {exc}") from None
    facts.ethernet_address = choose_ethernet_address(ssh, access, facts.interfaces, sections.get("ipconfig", ""))
    return facts
