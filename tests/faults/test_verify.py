"""JACKLRING_VERIFY=1 between real processes: every operation still gives the right result with
the checksums on (corruption itself is caught in tests/test_stream_engine.py, where a byte can
be flipped on the wire). JACCL's checksums are tested in tests/test_jaccl_mesh.py and tests/test_jaccl_exchange.py."""
from __future__ import annotations

import importlib.util

import pytest
from cluster import ROOT, base_env
from ranks import assert_all_ok, run

spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
soak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak)


@pytest.mark.timeout(120)
def test_ring_every_op_and_dtype_with_checksums():
    env = {k: v for k, v in base_env(JACKLRING_VERIFY="1").items() if k.startswith(("JACKLRING_", "PYTHON"))}
    # sizes cover the one-pass small path and the pipelined large path
    results = run(3, "ring_scripts/all_ops.py", ["0,5,70001"], env=env, timeout=100)
    assert_all_ok(results)


@pytest.mark.timeout(120)
def test_ring_mixed_soak_with_checksums(monkeypatch):
    """send/recv to any rank, broadcast, sum_scatter, barrier and split, all with checksums."""
    monkeypatch.setenv("JACKLRING_VERIFY", "1")
    results = soak.spawn(3, "ring", 400, seed=99, timeout=100)
    assert len(results) == 3 and all(res["fds"][0] == res["fds"][1] for res in results)
