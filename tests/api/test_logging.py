"""jacklring's logging follows the program's configuration: a rank with default settings writes
no INFO line to stderr, also when the program set the root logger to INFO (Ray's workers do),
and never configures the root logger, also when MLX_RING_VERBOSE asks for more."""
from __future__ import annotations

import json
import os
import sys

import pytest
import ranks

TORCH_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torch")


def run_ring(mode: str, **env: str) -> list[ranks.Rank]:
    base = {"MLX_RING_VERBOSE": "", "JACKLRING_TIMEOUT": "30"}
    base.update(env)
    found = ranks.run(2, "ring_scripts/logging_rank.py", [mode], timeout=60, env=base, fresh=True)
    ranks.assert_all_ok(found)
    return found


def report(rank: ranks.Rank) -> dict:
    line = next(l for l in rank.stdout.splitlines() if l.startswith("LOGGING "))
    return json.loads(line.split(" ", 1)[1])


def jacklring_info_lines(stderr: str) -> list[str]:
    return [l for l in stderr.splitlines() if l.startswith(("INFO:jacklring", "DEBUG:jacklring"))]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["none", "info"])
def test_default_settings_write_no_info_lines(mode):
    for r in run_ring(mode):
        assert report(r)["sum"] == 1.0
        assert report(r)["root_handlers_added"] == 0
        assert jacklring_info_lines(r.stderr) == [], r.stderr
        assert "a warning still shows" in r.stderr  # warnings are not silenced
        if mode == "none":
            assert "INFO" not in r.stderr, r.stderr


@pytest.mark.timeout(90)
def test_verbose_shows_details_without_configuring_the_root_logger():
    for r in run_ring("none", MLX_RING_VERBOSE="1"):
        assert report(r)["root_handlers_added"] == 0, r.stdout  # the program's own basicConfig still works
        assert report(r)["jacklring_level"] == "DEBUG"
        assert any("ring connected" in l for l in jacklring_info_lines(r.stderr)), r.stderr


@pytest.mark.timeout(90)
def test_torch_group_formed_through_the_store_emits_no_info_record():
    """init_process_group("jacklring") over tcp:// and a subgroup, under a root logger at INFO:
    jacklring's loggers emit no record below WARNING (the store ring's addresses and the
    subgroup's note were INFO lines in every rank's log)."""
    pytest.importorskip("torch")
    sys.path.insert(0, TORCH_TESTS)
    import torch_harness

    results = torch_harness.run(2, "logging_init.py", timeout=80)
    torch_harness.assert_all_ok(results, marker="LOGGING OK")
    for r in results:
        line = next(l for l in r.stdout.splitlines() if l.startswith("LOGGING {"))
        found = json.loads(line.split(" ", 1)[1])
        assert found["records"] == [], r.report()
        assert found["root_handlers_added"] == 0, r.report()
        assert jacklring_info_lines(r.stderr) == [], r.report()
