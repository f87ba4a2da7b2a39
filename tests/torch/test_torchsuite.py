"""torch's own DistributedTest (shipped in the torch wheel) against jacklring, world size 2, CPU.

The default run takes torchsuite.SUBSET (collectives, p2p, object collectives, DDP with uneven
inputs and join, comm hooks, batch_isend_irecv, monitored barrier); TORCHSUITE_FULL=1 runs every
test of torchsuite_expected.txt. Either way an expected test that fails, errors or is skipped
fails here, with torch's error for it.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torchsuite

pytestmark = pytest.mark.skipif(importlib.util.find_spec("expecttest") is None,
                                reason="expecttest (the 'test' extra) is not installed; torch's test utilities import it")

FULL = os.environ.get("TORCHSUITE_FULL") == "1"


def test_the_lists_are_consistent():
    expected, excluded = torchsuite.expected_tests(), torchsuite.excluded_tests()
    assert len(set(expected)) == len(expected), "a test is listed twice in torchsuite_expected.txt"
    assert not set(expected) & set(excluded), f"both expected and excluded: {sorted(set(expected) & set(excluded))}"
    assert all(excluded.values()), f"an exclusion without a reason: {[n for n, why in excluded.items() if not why]}"
    assert set(torchsuite.SUBSET) <= set(expected), \
        f"in the default subset but not expected to pass: {sorted(set(torchsuite.SUBSET) - set(expected))}"


@pytest.mark.timeout(1500 if FULL else 180)
def test_torch_distributed_test_passes_on_jacklring():
    names = torchsuite.expected_tests() if FULL else list(torchsuite.SUBSET)
    result = torchsuite.run_backend("jacklring", names, world_size=2, timeout=1450 if FULL else 170,
                                    test_timeout=60)
    broken = {name: result["failed"].get(name) or f"skipped: {result['skipped'].get(name)}"
              for name in names if name not in result["passed"]}
    broken.update({name: why for name, why in result["failed"].items() if name not in names})  # "(the run)"
    assert not broken, (f"{len(broken)} of {len(names)} expected tests did not pass on jacklring:\n"
                        + "\n".join(f"  {name}: {why}" for name, why in broken.items())
                        + "\n--- the run's last output:\n" + result.get("log", ""))
