"""torch.compile(DDP(model)) on the jacklring group trains as on gloo (Dynamo must not trace
into the Python process group), and dist.shrink_group then leaves the last rank out."""
from __future__ import annotations

import re

import pytest
import torch_harness as harness

pytest.importorskip("torch")


def _losses(results: list[harness.Result]) -> list[str]:
    harness.assert_all_ok(results, marker="COMPILED OK")
    return re.findall(r"LOSS \d+ \S+", results[0].stdout)


@pytest.mark.timeout(300)
def test_compiled_ddp_trains_like_gloo_and_shrink_group_leaves_a_rank_out():
    ours = harness.run(2, "compiled_ddp.py", "jacklring", "shrink", timeout=140)
    losses = _losses(ours)
    assert len(losses) == 4, ours[0].report()
    assert "SHRUNK 1 1" in ours[0].stdout and "SHRINK EXCLUDED" in ours[1].stdout, ours[0].report()
    assert losses == _losses(harness.run(2, "compiled_ddp.py", "gloo", timeout=140))
