"""Cable graphs from the recorded fixtures, ring and mesh detection, and what is missing."""
from __future__ import annotations

import pytest
from lc_fixtures import host_facts

from launcher.config.topology import (
    Cable,
    Topology,
    TopologyError,
    explain_no_mesh,
    explain_no_ring,
    find_ring,
    from_thunderbolt,
    is_full_mesh,
    longest_partial_ring,
    mesh_connections,
)

pytestmark = pytest.mark.timeout(30)


def topo_of(name: str) -> Topology:
    return from_thunderbolt(host_facts(name))


def graph(n: int, edges: list[tuple[int, int]]) -> Topology:
    """A hand-made topology: one cable per listed pair (repeat a pair for more cables)."""
    cables = [Cable(min(a, b), f"en{k}", max(a, b), f"en{k + 100}") for k, (a, b) in enumerate(edges)]
    return Topology([f"h{i}" for i in range(n)], cables, [])


def test_two_host_ring_with_one_cable():
    topo = topo_of("tb_ring2")
    assert topo.cables == [Cable(0, "en2", 1, "en2")]
    assert find_ring(topo) == ([0, 1], 1)
    assert is_full_mesh(topo)


def test_three_host_ring_ignores_the_dock():
    topo = topo_of("tb_ring3")
    assert topo.matrix() == [[0, 1, 1], [1, 0, 1], [1, 1, 0]]
    assert topo.warnings == []
    assert find_ring(topo) == ([0, 1, 2], 1)
    # studio-0 port 1 (en2) -> studio-1 port 2 (en3)
    assert topo.between(0, 1) == [Cable(0, "en2", 1, "en3")]


def test_four_host_ring_cabled_out_of_list_order():
    topo = topo_of("tb_ring4")
    assert not is_full_mesh(topo)
    order, connections = find_ring(topo)
    assert (order, connections) == ([0, 2, 1, 3], 1)
    counts = topo.matrix()
    assert all(counts[order[i]][order[(i + 1) % 4]] for i in range(4))


def test_full_mesh_of_four():
    topo = topo_of("tb_mesh4")
    assert is_full_mesh(topo) and topo.missing_pairs() == []
    assert len(topo.cables) == 6 and mesh_connections(topo) == 1
    assert find_ring(topo) == ([0, 1, 2, 3], 1)


def test_broken_mesh_names_the_missing_pair_but_still_has_a_ring():
    topo = topo_of("tb_mesh4_broken")
    assert not is_full_mesh(topo)
    assert topo.missing_pairs() == [("m3-ultra-1", "m3-ultra-2")]
    assert explain_no_mesh(topo) == "not a full mesh: no cable between m3-ultra-1 - m3-ultra-2"
    assert mesh_connections(topo) == 0
    assert find_ring(topo) == ([0, 2, 1, 3], 1)


def test_a_line_is_neither_ring_nor_mesh_and_the_message_says_why():
    topo = topo_of("tb_broken_line4")
    assert find_ring(topo) is None and not is_full_mesh(topo)
    why = explain_no_ring(topo)
    assert "mini-0 is cabled to mini-1 (a ring needs two neighbours)" in why
    assert "mini-3 is cabled to mini-2" in why
    assert "mini-1 is cabled" not in why
    assert explain_no_mesh(topo) == ("not a full mesh: no cable between mini-0 - mini-2, "
                                     "mini-0 - mini-3, mini-1 - mini-3")


def test_several_cables_per_pair_give_several_connections():
    topo = topo_of("tb_double2")
    assert topo.matrix() == [[0, 2], [2, 0]]
    assert find_ring(topo) == ([0, 1], 2)
    assert [c.a_iface for c in topo.between(1, 0)] == ["en2", "en3"]
    # Three hosts: 2, 1 and 2 cables on the three links -> the ring carries one connection per link.
    topo3 = topo_of("tb_double3")
    assert topo3.matrix() == [[0, 2, 2], [2, 0, 1], [2, 1, 0]]
    assert find_ring(topo3) == ([0, 1, 2], 1)


def test_cable_to_a_machine_outside_the_list_is_reported_and_ignored():
    topo = topo_of("tb_ring3_nordma")
    assert len(topo.cables) == 3
    assert topo.warnings == ["mbp-0: Thunderbolt 3 is cabled to a machine outside the host list "
                             "(MacBook Pro); ignored"]


def test_ring_prefers_the_ring_with_the_thickest_thinnest_link():
    # Ring A 0-1-2-3-0 has single cables; ring B 0-2-1-3-0 has two cables on every link.
    edges = [(0, 1), (1, 2), (2, 3), (3, 0)] + [(0, 2), (0, 2), (2, 1), (2, 1), (1, 3), (1, 3), (3, 0)]
    assert find_ring(graph(4, edges)) == ([0, 2, 1, 3], 2)


def test_ring_search_backtracks_past_dead_ends():
    # A 6-cycle plus chords that lure a greedy walk into a dead end: 0-1-2-3-4-5-0, 0-3, 1-4.
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 0), (0, 3), (1, 4)]
    order, connections = find_ring(graph(6, edges))
    assert sorted(order) == list(range(6)) and connections == 1
    topo = graph(6, edges)
    counts = topo.matrix()
    assert all(counts[order[i]][order[(i + 1) % 6]] for i in range(6))


def test_two_triangles_have_no_full_ring_but_a_partial_one():
    topo = graph(6, [(0, 1), (1, 2), (2, 0), (3, 4), (4, 5), (5, 3)])
    assert find_ring(topo) is None
    assert len(longest_partial_ring(topo)) == 3
    why = explain_no_ring(topo)
    assert "the longest ring covers only h0 -> h1 -> h2" in why


def test_single_host_and_too_many_hosts():
    assert find_ring(graph(1, [])) == ([0], 1)
    assert find_ring(graph(2, [])) is None
    assert explain_no_ring(graph(2, [])) == "no ring through every host: no cable between h0 and h1"
    with pytest.raises(TopologyError, match="too many"):
        find_ring(graph(17, []))
