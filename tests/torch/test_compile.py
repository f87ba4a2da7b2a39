"""torch.compile(DDP(model)), ddp.compile() and FSDP2 then torch.compile on the jacklring group
train as on gloo (Dynamo must not trace into the Python process group), and dist.shrink_group
then leaves the last rank out."""
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


def _variant_lines(results: list[harness.Result]) -> list[str]:
    harness.assert_all_ok(results, marker="VARIANTS OK")
    lines = re.findall(r"(?:LOSS|GRAPHS) \S+ .*", results[0].stdout)
    assert results[1].stdout.count("LOSS ") == results[0].stdout.count("LOSS "), results[1].report()
    return lines


@pytest.mark.timeout(300)
def test_ddp_compile_method_and_fsdp2_then_compile_train_like_gloo():
    """ddp.compile() (nn.Module.compile on the DDP wrapper) and fully_shard then torch.compile,
    under the "eager" compile backend (Dynamo traces, splits and guards as for inductor; the
    compiled graphs run eagerly: inductor's C++ build takes minutes on a small machine, and
    aot_eager doubled this test's time). Each compiles a graph and gives gloo's losses."""
    ours = harness.run(2, "compiled_variants.py", "jacklring", "eager", timeout=140)
    lines = _variant_lines(ours)
    assert "MESH BACKEND jacklring" in ours[0].stdout, ours[0].report()
    for variant in ("ddp.compile", "fsdp2+compile"):
        assert len([line for line in lines if line.startswith(f"LOSS {variant} ")]) == 3, ours[0].report()
        graphs = re.search(rf"GRAPHS {re.escape(variant)} (\d+)", ours[0].stdout)
        assert graphs and int(graphs.group(1)) >= 1, f"{variant} compiled nothing\n{ours[0].report()}"
    assert lines == _variant_lines(harness.run(2, "compiled_variants.py", "gloo", "eager", timeout=140))
