"""torch's own DistributedTest (shipped in the torch wheel) against jacklring, world size 2, CPU.

The default run takes every test of torchsuite_expected.txt (86, in two children at once): one that fails,
errors or is skipped fails here, with torch's error for it. TORCHSUITE_FULL=1 runs all of
DistributedTest on jacklring and on gloo instead (about 3 min) and checks both lists against the
run: every test gloo passes is expected on jacklring or excluded with a reason.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torchsuite
import zygote

pytestmark = pytest.mark.skipif(importlib.util.find_spec("expecttest") is None,
                                reason="expecttest (the 'test' extra) is not installed; torch's test utilities import it")

FULL = os.environ.get("TORCHSUITE_FULL") == "1"


def test_the_lists_are_consistent():
    expected, excluded = torchsuite.expected_tests(), torchsuite.excluded_tests()
    assert len(set(expected)) == len(expected), "a test is listed twice in torchsuite_expected.txt"
    assert not set(expected) & set(excluded), f"both expected and excluded: {sorted(set(expected) & set(excluded))}"
    assert all(excluded.values()), f"an exclusion without a reason: {[n for n, why in excluded.items() if not why]}"
    assert set(torchsuite.SUBSET) <= set(expected), \
        f"in the driver's subset but not expected to pass: {sorted(set(torchsuite.SUBSET) - set(expected))}"


def _not_passed(result: dict, names: list[str]) -> dict[str, str]:
    broken = {name: result["failed"].get(name) or f"skipped: {result['skipped'].get(name)}"
              for name in names if name not in result["passed"]}
    broken.update({name: why for name, why in result["failed"].items() if name not in names})  # "(the run)"
    return broken


@pytest.mark.skipif(FULL, reason="TORCHSUITE_FULL=1 runs test_every_test_against_the_lists instead")
@pytest.mark.timeout(180)
def test_expected_tests_pass_on_jacklring():
    names = torchsuite.expected_tests()
    # Two children at once: one keeps about one core busy (its two ranks mostly take turns).
    # Forked by the zygote: torch is imported once per pytest worker, not again in each child.
    result = torchsuite.run_backend("jacklring", names, world_size=2, timeout=170, test_timeout=60, shards=2,
                                    popen=zygote.popen)
    broken = _not_passed(result, names)
    assert not broken, (f"{len(broken)} of {len(names)} expected tests did not pass on jacklring:\n"
                        + "\n".join(f"  {name}: {why}" for name, why in broken.items())
                        + "\n--- the run's last output:\n" + result.get("log", ""))


@pytest.mark.skipif(not FULL, reason="the full run (about 3 min): TORCHSUITE_FULL=1")
@pytest.mark.timeout(900)
def test_every_test_against_the_lists():
    names = torchsuite.every_test()
    ours = torchsuite.run_backend("jacklring", names, world_size=2, timeout=420, test_timeout=60)
    gloo = torchsuite.run_backend("gloo", names, world_size=2, timeout=420, test_timeout=60)
    problems = torchsuite.check_lists(names, set(ours["passed"]), set(gloo["passed"]))
    problems += [f"the {b} run: {why}" for b, r in (("jacklring", ours), ("gloo", gloo))
                 for n, why in r["failed"].items() if n == "(the run)"]
    assert not problems, "\n".join(problems) + "\n--- jacklring's failures:\n" + "\n".join(
        f"  {n}: {why}" for n, why in ours["failed"].items())
