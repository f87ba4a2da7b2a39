"""Checks of the jacklring torch group that each need two ranks and end with the group
destroyed: synchronous collectives run inline, every Future is done when wait() returns, and
training matches gloo (DDP and its options, comm hooks, ZeRO, FSDP2). One launch of two ranks
runs their scripts one after the other (workers/parts.py: each on a group and port of its own)
and each test reads its script's part: one launch instead of three saves four imports of torch
(seconds of CPU each). The file is one xdist group (tests/conftest.py), so its tests see the
same launch."""
from __future__ import annotations

import re

import pytest
import torch_harness as harness

pytest.importorskip("torch")

# inline first: it checks that no helper thread runs and counts Python calls in adapter/, which
# no earlier part's leftovers may change
PARTS = ("inline.py", "futures.py:success", "training.py")


@pytest.fixture(scope="module")
def launch() -> list[harness.Result]:
    # alone: inline 80 s, futures 110 s, training 110 s
    return harness.launch_parts(2, PARTS, 300)


# The first test to run also waits for the launch (300 s at most).
@pytest.mark.timeout(400)
def test_synchronous_collectives_run_inline_and_async_ones_keep_order_and_callbacks(launch):
    """Inline execution of synchronous collectives (docs/torch.md, "Execution model")."""
    harness.part(launch, "inline.py", "INLINE ALL OK")


@pytest.mark.timeout(400)
def test_future_is_done_when_wait_returns_for_thousands_of_async_ops(launch):
    for r in harness.part(launch, "futures.py:success", "futures ALL OK"):
        match = re.search(r"NOT DONE AFTER WAIT: (\d+) of (\d+)", r.stdout)
        assert match and int(match.group(1)) == 0 and int(match.group(2)) >= 1000, r.report()


@pytest.mark.timeout(400)
def test_training_parameters_equal_gloo_ddp_hooks_zero_fsdp2(launch):
    results = harness.part(launch, "training.py", "training ALL OK")
    for case in ("ddp", "bucket_view", "unused", "no_sync", "bf16", "static_graph",
                 "fp16_hook", "powersgd", "sparse", "zero", "fsdp2"):
        assert f"{case}: parameters match gloo" in results[0].stdout
