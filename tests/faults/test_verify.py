"""JACKLRING_VERIFY=1 between real processes: every operation still gives the right result with
the checksums on (every op and dtype: the ring-checksums variant of tests/contract; corruption
itself is caught in tests/transport/test_stream_engine.py, where a byte can be flipped on the wire).
JACCL's checksums are tested in tests/jaccl/test_jaccl_mesh.py and tests/jaccl/test_jaccl_exchange.py."""
from __future__ import annotations

import importlib.util

import pytest
from cluster import ROOT

spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
soak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak)


@pytest.mark.timeout(120)
def test_ring_mixed_soak_with_checksums(monkeypatch):
    """send/recv to any rank, broadcast, sum_scatter, barrier and split, all with checksums."""
    monkeypatch.setenv("JACKLRING_VERIFY", "1")
    results = soak.spawn(3, "ring", 400, seed=99, timeout=100)
    assert len(results) == 3 and all(res["fds"][0] == res["fds"][1] for res in results)
