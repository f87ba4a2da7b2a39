"""Libraries call torch.distributed.monitored_barrier, which torch limits to gloo:
adapter.torch_backend.route_monitored_barrier() makes that call work on jacklring groups."""
from __future__ import annotations

import pytest
import torch_harness as harness

pytest.importorskip("torch")


@pytest.mark.timeout(90)
def test_torch_monitored_barrier_routed_names_the_late_rank_of_three_and_the_group_stays_usable():
    """After the timeout the group is used again: with the failed barrier's receives left
    posted, the next barrier's release went to them and the ranks timed out once more."""
    results = harness.run(3, "routed_monitored_barrier.py", timeout=80)
    harness.assert_all_ok(results, marker="ROUTED OK")
    for r in results:
        assert "the group works after the failed barrier" in r.stdout, r.report()
    assert "Rank 2 failed to pass monitoredBarrier in 1000 ms" in results[0].stdout, results[0].report()
    assert "Rank 1 successfully reached monitoredBarrier" in results[1].stdout, results[1].report()
    assert "Rank 2 successfully reached monitoredBarrier" in results[2].stdout, results[2].report()
