"""Checks of the jacklring torch group that each need three ranks and end with the group as
they found it or destroyed: every op against gloo, point-to-point, forming the group again and
again, torch's own monitored_barrier routed to jacklring, and the gloo features a torch user
expects (recv from any source, batch_isend_irecv, DDP join, monitored_barrier). One launch of
three ranks runs their scripts one after the other (workers/parts.py: each on a group and port
of its own) and each test reads its script's part. Three ranks importing torch cost seconds of
CPU; one launch instead of six saves fifteen imports. The file is one xdist group
(tests/conftest.py), so its tests see the same launch."""
from __future__ import annotations

import pytest
import torch_harness as harness

pytest.importorskip("torch")

# monitored last: it leaves failed barriers behind (nothing is destroyed after the last part)
PARTS = ("ops_parity.py", "p2p.py", "lifecycle.py", "routed_monitored_barrier.py",
         "torch_features.py:anysource,batch,join", "torch_features.py:monitored")


@pytest.fixture(scope="module")
def launch() -> list[harness.Result]:
    # alone, each had 80 s (join's 150 s): join trains four models, about 45 s on a loaded 2-core host
    return harness.launch_parts(3, PARTS, 330)


# The first test to run also waits for the launch (330 s at most).
@pytest.mark.timeout(420)
def test_every_op_matches_gloo_with_three_ranks(launch):
    harness.part(launch, "ops_parity.py", "checks ALL OK")


@pytest.mark.timeout(420)
def test_point_to_point_any_peer_irecv_before_isend_and_tags(launch):
    harness.part(launch, "p2p.py", "p2p ALL OK")


@pytest.mark.timeout(420)
def test_destroy_and_init_again_over_file_tcp_twice_and_env(launch):
    """torch keeps the TCPStore of a port alive after destroy_process_group and names the new
    groups as the old ones: the second group must not read the first one's addresses."""
    harness.part(launch, "lifecycle.py", "lifecycle ALL OK")


@pytest.mark.timeout(420)
def test_torch_monitored_barrier_routed_names_the_late_rank_of_three_and_the_group_stays_usable(launch):
    """Libraries call torch.distributed.monitored_barrier, which torch limits to gloo:
    the first jacklring group routes that call to jacklring's barrier, without the program's help.
    After the timeout the group is used again: with the failed barrier's receives left posted,
    the next barrier's release went to them and the ranks timed out once more."""
    results = harness.part(launch, "routed_monitored_barrier.py", "ROUTED OK", "the group works after the failed barrier")
    assert "Rank 2 failed to pass monitoredBarrier in 1000 ms" in results[0].stdout, results[0].report()
    assert "Rank 1 successfully reached monitoredBarrier" in results[1].stdout, results[1].report()
    assert "Rank 2 successfully reached monitoredBarrier" in results[2].stdout, results[2].report()


@pytest.mark.timeout(420)
@pytest.mark.parametrize("modes", ["anysource,batch,join", "monitored"])
def test_gloo_features_on_three_ranks(launch, modes):
    """The modes that leave the group working in one part, monitored in one of its own."""
    results = harness.part(launch, f"torch_features.py:{modes}", *(f"{mode} OK" for mode in modes.split(",")))
    if modes == "monitored":
        assert "Rank 2 failed to pass monitoredBarrier in 1000 ms" in results[0].stdout, results[0].report()
        assert "Ranks 1, 2 failed to pass monitoredBarrier" in results[0].stdout, results[0].report()
        assert "Rank 1 successfully reached monitoredBarrier, but received errors" in results[1].stdout, results[1].report()
