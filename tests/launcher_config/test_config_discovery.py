"""The discovery parsers over recorded command output (fixtures/*.json, see make_fixtures.py)."""
from __future__ import annotations

import ipaddress
import json

import pytest
from lc_fixtures import host_facts, load

from launcher.config.discovery import (
    SECTION_MARK,
    AccessInfo,
    ProbeError,
    choose_ethernet_address,
    parse_access,
    parse_hardware_ports,
    parse_ibv_devices,
    parse_ip_addr,
    parse_probe,
    parse_sysfs_rdma,
    parse_thunderbolt,
    split_sections,
    ssh_server_address,
)

pytestmark = pytest.mark.timeout(30)

IBV_SPEC = """    device          \t   node GUID
    ------          \t----------------
    rdma_en2        \t8096a9d9edbaac05
    rdma_en3        \t8196a9d9edbaac05
    rdma_en5        \t8396a9d9edbaac05
"""


def test_split_sections_keeps_each_body_and_ignores_preamble():
    text = f"motd noise\n{SECTION_MARK}a\none\ntwo\n{SECTION_MARK}b\n{SECTION_MARK}c\nthree\n"
    assert split_sections(text) == {"a": "one\ntwo", "b": "", "c": "three"}


def test_access_probe_output():
    text = (f"{SECTION_MARK}uname\nDarwin\n{SECTION_MARK}uid\n501\n"
            f"{SECTION_MARK}ssh_connection\n192.168.1.5 50514 192.168.1.21 22\n{SECTION_MARK}sudo\nno\n")
    info = parse_access(text)
    assert info == AccessInfo(system="Darwin", uid=501, ssh_server_address="192.168.1.21", has_sudo=False)
    assert not info.is_root


def test_access_probe_without_markers_is_a_clear_error():
    with pytest.raises(ProbeError, match="POSIX sh"):
        parse_access("fish: Unknown command\n")


@pytest.mark.parametrize("env, expected", [
    ("10.0.0.1 51234 10.0.0.7 22", "10.0.0.7"),
    ("::ffff:10.0.0.1 51234 ::ffff:10.0.0.7 22", "10.0.0.7"),
    ("fe80::1%eth0 5000 fe80::2%eth0 22", "fe80::2"),
    ("", None),
    ("garbage", None),
    ("1.2.3.4 1 not-an-ip 22", None),
])
def test_ssh_server_address(env, expected):
    assert ssh_server_address(env) == expected


def test_hardware_ports_from_recorded_mac_studio():
    host = load("tb_mesh4")["hosts"][0]
    ports = parse_hardware_ports(host["hardware_ports"])
    assert ports["Ethernet"] == "en0"
    assert ports["Wi-Fi"] == "en1"
    assert ports["Thunderbolt Bridge"] == "bridge0"
    assert [ports[f"Thunderbolt {r}"] for r in range(1, 7)] == ["en2", "en3", "en4", "en5", "en6", "en7"]
    assert "VLAN Configurations" not in ports


def test_ibv_devices_table_and_absence():
    assert [d.name for d in parse_ibv_devices(IBV_SPEC)] == ["rdma_en2", "rdma_en3", "rdma_en5"]
    assert parse_ibv_devices("") == []
    # Header only: RDMA userspace present, no device enabled.
    assert parse_ibv_devices("    device          \t   node GUID\n    ------          \t----------------\n") == []


def test_thunderbolt_ports_map_receptacles_to_interfaces_and_peers():
    fixture = load("tb_ring3")["hosts"]
    sp = [json.dumps(h["system_profiler"]) for h in fixture]
    hw = [parse_hardware_ports(h["hardware_ports"]) for h in fixture]
    ports = [parse_thunderbolt(s, m) for s, m in zip(sp, hw)]
    assert [p.receptacle for p in ports[0]] == ["1", "2", "3", "4", "5", "6"]
    assert [p.iface for p in ports[0]] == ["en2", "en3", "en4", "en5", "en6", "en7"]
    # studio-0 port 1 goes to studio-1 port 2: its peer UUID is that bus's own UUID.
    assert ports[0][0].peer_uuid == ports[1][1].uuid
    assert ports[1][1].peer_uuid == ports[0][0].uuid
    assert ports[0][0].peer_name == "Mac Studio" and ports[0][0].speed == "Up to 80 Gb/s"
    # Unconnected ports have no peer; a dock (no domain UUID of its own) is not a peer either.
    assert ports[0][5].peer_uuid is None
    assert ports[2][4].peer_uuid is None


def test_thunderbolt_port_without_network_interface_is_kept_with_no_iface():
    host = load("tb_ring2")["hosts"][0]
    ports = parse_thunderbolt(json.dumps(host["system_profiler"]), {"Thunderbolt 1": "en2"})
    assert ports[0].iface == "en2" and ports[1].iface is None


def test_thunderbolt_bad_json_and_empty_output():
    with pytest.raises(ProbeError, match="invalid JSON"):
        parse_thunderbolt('{"SPThunderboltDataType": [', {})
    assert parse_thunderbolt("", {}) == []          # no Thunderbolt at all (or not a Mac)
    assert parse_thunderbolt('{"SPThunderboltDataType": [{"_name": "x"}]}', {}) == []


def test_linux_ip_json_interfaces():
    host = load("linux_roce2")["hosts"][0]
    interfaces = {i.name: i for i in parse_ip_addr(host["ip_addr"], host["ip_link"])}
    assert set(interfaces) == {"lo", "eno1", "ens1f0np0", "ens1f1np1", "docker0"}
    assert interfaces["lo"].loopback and interfaces["lo"].up
    assert interfaces["ens1f0np0"].up and ipaddress.ip_interface("10.20.0.11/24") in interfaces["ens1f0np0"].addresses
    assert not interfaces["ens1f1np1"].up            # NO-CARRIER, operstate DOWN
    assert not interfaces["docker0"].up
    assert interfaces["eno1"].mac.count(":") == 5
    assert any(a.version == 6 for a in interfaces["eno1"].addresses)


def test_linux_ip_json_errors_are_probe_errors():
    with pytest.raises(ProbeError, match="ip -j addr"):
        parse_ip_addr("{not json")
    with pytest.raises(ProbeError, match="not a list"):
        parse_ip_addr('{"ifname": "lo"}')


def test_sysfs_rdma_lines():
    devices = parse_sysfs_rdma("mlx5_0|4: ACTIVE|ens1f0np0 \nmlx5_1|1: DOWN|ens1f1np1 \nrxe0||\n")
    assert [(d.name, d.netdevs, d.active) for d in devices] == [
        ("mlx5_0", ("ens1f0np0",), True), ("mlx5_1", ("ens1f1np1",), False), ("rxe0", (), None)]
    with pytest.raises(ProbeError):
        parse_sysfs_rdma("just-a-name\n")


def test_ethernet_address_prefers_the_address_ssh_came_in_on():
    host = load("linux_roce2")["hosts"][0]
    interfaces = parse_ip_addr(host["ip_addr"], host["ip_link"])
    via_ssh = AccessInfo("Linux", 1000, "10.20.0.11", True)
    # eno1 (192.168.1.111) comes first in the list, yet the host was reached on 10.20.0.11.
    assert choose_ethernet_address("gpu-a", via_ssh, interfaces) == "10.20.0.11"
    # Loopback test hosts: 127.0.0.2 is answered by lo although lo lists only 127.0.0.1/8.
    assert choose_ethernet_address("127.0.0.2", AccessInfo("Linux", 0, "127.0.0.2", True), interfaces) == "127.0.0.2"
    unknown = AccessInfo("Linux", 1000, None, True)
    assert choose_ethernet_address("10.1.2.3", unknown, interfaces) == "10.1.2.3"
    assert choose_ethernet_address("gpu-a", unknown, interfaces) == "192.168.1.111"
    assert choose_ethernet_address("mac", AccessInfo("Darwin", 501, None, True), [], "192.168.1.9\n") == "192.168.1.9"
    assert choose_ethernet_address("mac", AccessInfo("Darwin", 501, None, True), []) is None


def test_facts_from_every_fixture():
    mesh = host_facts("tb_mesh4")
    assert [f.ssh for f in mesh] == ["m3-ultra-1", "m3-ultra-2", "m3-ultra-3", "m3-ultra-4"]
    assert all(f.is_macos and len(f.thunderbolt) == 6 for f in mesh)
    assert mesh[0].ethernet_address == "192.168.1.21"
    assert mesh[0].rdma_for_iface("en5") == "rdma_en5"
    nordma = host_facts("tb_ring3_nordma")
    assert all(f.rdma == [] and f.rdma_for_iface("en1") is None for f in nordma)
    linux = host_facts("linux_roce2")
    assert linux[1].ethernet_address == "10.20.0.12"
    assert linux[1].rdma_for_iface("ens1f0np0") == "mlx5_0"
    plain = host_facts("linux_plain2")
    assert plain[0].rdma == [] and plain[0].ethernet_address == "10.20.0.21"


def test_probe_error_names_the_host():
    access = AccessInfo("Darwin", 501, None, True)
    with pytest.raises(ProbeError, match="^mac-9: system_profiler printed invalid JSON"):
        parse_probe("mac-9", access, f"{SECTION_MARK}system_profiler\n{{oops\n")
