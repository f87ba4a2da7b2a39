"""IP plan, setup commands, backend choice, DOT and the hostfiles (checked by launcher.hostfile)."""
from __future__ import annotations

import argparse
import ipaddress

import pytest
from lc_fixtures import host_facts

from launcher.config.cli import Context, choose_tb_backend
from launcher.config.netplan import (
    Command,
    PlanError,
    check_no_clash,
    format_commands,
    host_commands,
    linux_commands,
    plan_addresses,
)
from launcher.config.output import (
    OutputError,
    ethernet_hostfile,
    jaccl_hostfile,
    jaccl_ring_hostfile,
    ring_hostfile,
    to_dot,
)
from launcher.config.topology import TopologyError, find_ring, from_thunderbolt
from launcher.hostfile import dump_hostfile, parse_hostfile

pytestmark = pytest.mark.timeout(30)


def setup(name):
    facts = host_facts(name)
    return facts, from_thunderbolt(facts)


def ctx(backend=None):
    return Context(argparse.Namespace(backend=backend, verbose=False))


def accepted(hostfile):
    """What `launcher` would read back from the written file."""
    return parse_hostfile(dump_hostfile(hostfile), source="test")


# ---- IP plan ---------------------------------------------------------------------------------

def test_one_slash30_per_cable_in_cable_order():
    facts, topo = setup("tb_mesh4")
    plan = plan_addresses(topo)
    nets = [link.network for link in plan.links]
    assert [str(n) for n in nets] == [f"10.99.0.{4 * k}/30" for k in range(6)]
    assert all(not a.overlaps(b) for i, a in enumerate(nets) for b in nets[i + 1:])
    first = plan.links[0]
    assert (first.cable.a, first.cable.b) == (0, 1)
    assert (str(first.a_address), str(first.b_address)) == ("10.99.0.1", "10.99.0.2")
    assert plan.addresses_towards(1, 0) == ["10.99.0.2"]
    assert all(link.a_address in link.network and link.b_address in link.network for link in plan.links)


def test_plan_respects_subnet_and_rejects_bad_blocks():
    _, topo = setup("tb_double3")   # 5 cables
    plan = plan_addresses(topo, "192.168.77.0/24")
    assert str(plan.links[-1].network) == "192.168.77.16/30"
    with pytest.raises(PlanError, match="holds 4 links"):
        plan_addresses(topo, "10.1.1.0/28")
    with pytest.raises(PlanError, match="private"):
        plan_addresses(topo, "8.8.8.0/24")
    with pytest.raises(PlanError, match="--subnet"):
        plan_addresses(topo, "10.1.1.1/24")      # host bits set


def test_plan_refuses_a_block_that_clashes_with_the_lan():
    facts, topo = setup("tb_ring2")              # the Macs live on 192.168.1.0/24
    plan = plan_addresses(topo, "192.168.0.0/16")
    with pytest.raises(PlanError, match=r"mini-a: its address 192.168.1.31 lies inside"):
        check_no_clash(plan, facts, "192.168.0.0/16")
    check_no_clash(plan_addresses(topo), facts)  # the default block is free


def test_linux_clash_check_ignores_our_own_addresses_from_a_previous_run():
    facts = host_facts("linux_plain2")
    facts_topo = from_thunderbolt(facts)         # Linux hosts have no Thunderbolt cables
    assert facts_topo.cables == []
    with pytest.raises(PlanError, match="cpu-a: docker0 already has 172.17.0.1/16"):
        check_no_clash(plan_addresses(facts_topo, "172.17.8.0/22"), facts, "172.17.8.0/22")


# ---- commands ---------------------------------------------------------------------------------

def test_macos_commands_disable_the_bridge_then_address_each_cable():
    facts, topo = setup("tb_ring3")
    plan = plan_addresses(topo)
    commands = host_commands(plan, facts)
    studio0 = [c.argv for c in commands[0]]
    assert studio0[0] == ("networksetup", "-setnetworkserviceenabled", "Thunderbolt Bridge", "off")
    assert studio0[1] == ("ifconfig", "bridge0", "down")
    # studio-0 has cables on en2 (to studio-1) and en3 (to studio-2).
    assert ("ifconfig", "en2", "inet", "10.99.0.1", "netmask", "255.255.255.252") in studio0
    assert ("route", "-n", "change", "-host", "10.99.0.2", "-interface", "en2") in studio0
    assert ("ifconfig", "en3", "inet", "10.99.0.5", "netmask", "255.255.255.252") in studio0
    text = format_commands(topo.hosts, commands, [True, True, False])
    assert "Setup for studio-0\n==================\nsudo networksetup -setnetworkserviceenabled " \
           "'Thunderbolt Bridge' off || true\n" in text
    # studio-2 runs as root: no sudo; its en2 is cabled to studio-0 (second cable, second /30)
    assert "\nifconfig en2 inet 10.99.0.6 netmask 255.255.255.252\n" in text


def test_linux_commands_use_ip_addr_replace():
    facts, topo = setup("tb_ring2")
    plan = plan_addresses(topo)
    assert [c.argv for c in linux_commands(plan, 1)] == [
        ("ip", "link", "set", "dev", "en2", "up"),
        ("ip", "addr", "replace", "10.99.0.2/30", "dev", "en2"),
    ]
    assert Command(("ip", "link", "set", "dev", "x y", "up")).shell() == "sudo ip link set dev 'x y' up"


# ---- backend choice ---------------------------------------------------------------------------

@pytest.mark.parametrize("fixture, backend", [
    ("tb_mesh4", "jaccl"), ("tb_mesh4_broken", "jaccl-ring"), ("tb_ring4", "jaccl-ring"),
    ("tb_ring3_nordma", "ring"), ("tb_double2", "jaccl"),
])
def test_default_backend_is_the_best_the_hardware_supports(fixture, backend):
    facts, topo = setup(fixture)
    assert choose_tb_backend(ctx(), topo, facts)[0] == backend


def test_explicit_backend_errors_name_what_is_missing():
    facts, topo = setup("tb_mesh4_broken")
    with pytest.raises(TopologyError, match="no cable between m3-ultra-1 - m3-ultra-2"):
        choose_tb_backend(ctx("jaccl"), topo, facts)
    facts, topo = setup("tb_ring3_nordma")
    with pytest.raises(TopologyError, match=r"missing on mbp-0 en1, mbp-1 en2"):
        choose_tb_backend(ctx("jaccl-ring"), topo, facts)
    facts, topo = setup("tb_broken_line4")
    with pytest.raises(TopologyError, match="neither a full mesh nor a ring.*mini-0 - mini-2"):
        choose_tb_backend(ctx(), topo, facts)
    with pytest.raises(TopologyError, match="ring: no ring through every host: mini-0 is cabled to mini-1"):
        choose_tb_backend(ctx("ring"), topo, facts)


# ---- hostfiles --------------------------------------------------------------------------------

def test_jaccl_hostfile_matches_the_mlx_documentation_example():
    facts, topo = setup("tb_mesh4")
    hostfile = accepted(jaccl_hostfile(topo, facts, 1, ["MLX_METAL_FAST_SYNCH=1"]))
    assert hostfile.backend == "jaccl" and hostfile.envs == ["MLX_METAL_FAST_SYNCH=1"]
    assert [h.rdma for h in hostfile.hosts] == [
        [None, "rdma_en5", "rdma_en4", "rdma_en3"],
        ["rdma_en5", None, "rdma_en3", "rdma_en4"],
        ["rdma_en4", "rdma_en3", None, "rdma_en5"],
        ["rdma_en3", "rdma_en4", "rdma_en5", None],
    ]
    assert hostfile.hosts[0].ips == ["192.168.1.21"]   # rank 0's coordinator address


def test_jaccl_hostfile_with_two_cables_lists_both_devices():
    facts, topo = setup("tb_double2")
    hostfile = accepted(jaccl_hostfile(topo, facts, 2, []))
    assert hostfile.hosts[0].rdma == [None, ["rdma_en2", "rdma_en3"]]


def test_jaccl_without_rdma_names_host_and_interface():
    facts, topo = setup("tb_ring3_nordma")
    with pytest.raises(OutputError, match=r"mbp-0: no RDMA device on en1 \(ibv_devices lists none\)"):
        jaccl_hostfile(topo, facts, 1, [])


def test_ring_hostfile_lists_each_ranks_end_of_the_cable_from_its_left_neighbour():
    facts, topo = setup("tb_ring4")
    plan = plan_addresses(topo)
    order, connections = find_ring(topo)
    hostfile = accepted(ring_hostfile(topo, plan, order, connections, ["A=1"]))
    assert [h.ssh for h in hostfile.hosts] == ["mini-0", "mini-2", "mini-1", "mini-3"]
    for rank, host in enumerate(hostfile.hosts):
        left = order[rank - 1]
        (ip,) = host.ips
        link = plan.for_cable(topo.between(order[rank], left)[0])
        assert ip == str(link.address_of(order[rank]))
        # the left neighbour's end of that cable is in the same /30: it can connect directly
        assert ipaddress.ip_address(ip) in link.network
        assert link.address_of(left) != ipaddress.ip_address(ip)
    assert hostfile.envs == ["A=1"] and hostfile.backend == "ring"


def test_ring_hostfile_with_two_cables_gives_two_connections():
    facts, topo = setup("tb_double2")
    plan = plan_addresses(topo)
    hostfile = accepted(ring_hostfile(topo, plan, *find_ring(topo), []))
    assert [h.ips for h in hostfile.hosts] == [["10.99.0.1", "10.99.0.5"], ["10.99.0.2", "10.99.0.6"]]


def test_jaccl_ring_hostfile_has_devices_towards_neighbours_only():
    facts, topo = setup("tb_ring4")
    order, connections = find_ring(topo)
    hostfile = accepted(jaccl_ring_hostfile(topo, facts, order, connections, []))
    assert hostfile.backend == "jaccl-ring"
    rows = [h.rdma for h in hostfile.hosts]
    for rank, row in enumerate(rows):
        assert row[rank] is None
        assert [j for j, cell in enumerate(row) if cell] == sorted({(rank - 1) % 4, (rank + 1) % 4})
    # rank 0 (mini-0) reaches rank 1 (mini-2) over its port 1 (en2), rank 3 (mini-3) over port 2 (en3).
    assert rows[0] == [None, "rdma_en2", None, "rdma_en3"]
    assert hostfile.hosts[0].ips == ["192.168.1.50"]


def test_ethernet_hostfiles_for_linux_hosts():
    facts = host_facts("linux_roce2")
    ring = accepted(ethernet_hostfile(facts, "ring", ["NCCL_DEBUG=INFO"]))
    assert [h.ips for h in ring.hosts] == [["10.20.0.11"], ["10.20.0.12"]]
    assert all(h.rdma == [] for h in ring.hosts)
    jaccl = accepted(ethernet_hostfile(facts, "jaccl", []))
    assert [h.rdma for h in jaccl.hosts] == [[None, "mlx5_0"], ["mlx5_0", None]]
    with pytest.raises(OutputError, match="cpu-a: no RDMA device found"):
        ethernet_hostfile(host_facts("linux_plain2"), "jaccl", [])


# ---- DOT --------------------------------------------------------------------------------------

def test_dot_has_a_node_per_host_and_an_edge_per_cable():
    facts, topo = setup("tb_double3")
    dot = to_dot(topo)
    assert dot.startswith("graph topology {\n") and dot.endswith("}\n")
    assert dot.count("[label=\"studio-") == 3
    edges = [line.strip() for line in dot.splitlines() if " -- " in line]
    assert len(edges) == 5
    assert edges.count('h0 -- h1 [label="en2 / en2"];') == 1
    assert edges.count('h0 -- h1 [label="en3 / en3"];') == 1
    with_plan = to_dot(topo, plan_addresses(topo))
    assert 'h0 -- h1 [label="en2 / en2\\n10.99.0.0/30"];' in with_plan


def test_dot_quotes_odd_host_names():
    facts, topo = setup("tb_ring2")
    topo.hosts[0] = 'we"ird\\name'
    assert 'h0 [label="we\\"ird\\\\name"];' in to_dot(topo)


# ---- the CLI's Thunderbolt flow on recorded hosts (everything after ssh) -----------------------

def tb_args(**overrides):
    values = dict(backend=None, verbose=False, dot=False, auto_setup=False, subnet="10.99.0.0/16")
    values.update(overrides)
    return Context(argparse.Namespace(**values))


def access_report(facts, sudo=True, uid=501):
    from launcher.config.discovery import AccessInfo
    from launcher.config.ssh import HostAccess
    return [HostAccess(f.ssh, AccessInfo("Darwin", uid, f.ethernet_address, sudo)) for f in facts]


def test_cli_flow_prints_per_host_commands_and_a_jaccl_hostfile():
    from launcher.config.cli import configure_thunderbolt
    facts = host_facts("tb_mesh4")
    hostfile, printed = configure_thunderbolt(tb_args(), None, access_report(facts), facts, ["K=V"])
    assert hostfile.backend == "jaccl" and hostfile.envs == ["K=V"]
    assert [line for line in printed.splitlines() if line.startswith("Setup for")] == [
        f"Setup for m3-ultra-{i}" for i in range(1, 5)]
    assert printed.count("sudo ifconfig en") == 12        # 6 cables, two ends each


def test_cli_flow_ring_dot_and_sudo_refusal():
    from launcher.config.cli import UsageError, configure_thunderbolt
    facts = host_facts("tb_ring3_nordma")
    hostfile, printed = configure_thunderbolt(tb_args(), None, access_report(facts, uid=0), facts, [])
    assert hostfile.backend == "ring" and "sudo" not in printed   # root: commands without sudo
    assert [len(h.ips) for h in hostfile.hosts] == [1, 1, 1]
    none, dot = configure_thunderbolt(tb_args(dot=True), None, access_report(facts), facts, [])
    assert none is None and dot.count(" -- ") == 3
    with pytest.raises(UsageError, match=r"--auto-setup needs passwordless sudo .* on mbp-0, mbp-1, mbp-2"):
        configure_thunderbolt(tb_args(auto_setup=True), None, access_report(facts, sudo=False), facts, [])


def test_cli_flow_needs_two_hosts_for_thunderbolt():
    from launcher.config.cli import UsageError, configure_thunderbolt
    facts = host_facts("tb_ring2")[:1]
    with pytest.raises(UsageError, match="at least two hosts"):
        configure_thunderbolt(tb_args(), None, access_report(facts), facts, [])
