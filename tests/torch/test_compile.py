"""torch.compile(DDP(model)), ddp.compile() and FSDP2 then torch.compile on the jacklring group
train as on gloo (Dynamo must not trace into the Python process group), and dist.shrink_group
then leaves the last rank out."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch_harness as harness

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def launches() -> dict[str, list[harness.Result]]:
    """workers/compiled.py on jacklring (then shrink_group) and on gloo, the two launches side
    by side; both tests read their part of each. One launch per backend instead of one per test
    and backend: each rank pays the import of torch and Dynamo's warm-up (seconds of CPU) once.
    The file is one xdist group (tests/conftest.py), so both tests see the same launches."""
    our_port, gloo_port = harness.free_ports(2)
    ours = harness.spawn(2, "compiled.py", "jacklring", "eager", "shrink", port=our_port)
    gloo = harness.spawn(2, "compiled.py", "gloo", "eager", port=gloo_port)
    return {"jacklring": harness.collect(ours, 140), "gloo": harness.collect(gloo, 140)}


def _part(results: list[harness.Result], name: str) -> list[harness.Result]:
    """Each rank's output of one part of compiled.py (from its '=== name' line to the next part)."""
    return [dataclasses.replace(r, stdout=harness.section(r.stdout, name) or r.stdout) for r in results]


def _losses(results: list[harness.Result]) -> list[str]:
    harness.assert_all_ok(results, marker="COMPILED OK")
    return re.findall(r"LOSS \d+ \S+", results[0].stdout)


# Timeouts: the first test of the two also waits for the launches (140 s each at most).
@pytest.mark.timeout(300)
def test_compiled_ddp_trains_like_gloo_and_shrink_group_leaves_a_rank_out(launches):
    ours = _part(launches["jacklring"], "DDP")
    losses = _losses(ours)
    assert len(losses) == 4, ours[0].report()
    assert "SHRUNK 1 1" in ours[0].stdout and "SHRINK EXCLUDED" in ours[1].stdout, ours[0].report()
    assert losses == _losses(_part(launches["gloo"], "DDP"))


def _variant_lines(results: list[harness.Result]) -> list[str]:
    harness.assert_all_ok(results, marker="VARIANTS OK")
    lines = re.findall(r"(?:LOSS|GRAPHS) \S+ .*", results[0].stdout)
    assert results[1].stdout.count("LOSS ") == results[0].stdout.count("LOSS "), results[1].report()
    return lines


@pytest.mark.timeout(300)
def test_ddp_compile_method_and_fsdp2_then_compile_train_like_gloo(launches):
    """ddp.compile() (nn.Module.compile on the DDP wrapper) and fully_shard then torch.compile,
    under the "eager" compile backend (Dynamo traces, splits and guards as for inductor; the
    compiled graphs run eagerly: inductor's C++ build takes minutes on a small machine, and
    aot_eager doubled this test's time). Each compiles a graph and gives gloo's losses."""
    ours = _part(launches["jacklring"], "VARIANTS")
    lines = _variant_lines(ours)
    assert "MESH BACKEND jacklring" in ours[0].stdout, ours[0].report()
    for variant in ("ddp.compile", "fsdp2+compile"):
        assert len([line for line in lines if line.startswith(f"LOSS {variant} ")]) == 3, ours[0].report()
        graphs = re.search(rf"GRAPHS {re.escape(variant)} (\d+)", ours[0].stdout)
        assert graphs and int(graphs.group(1)) >= 1, f"{variant} compiled nothing\n{ours[0].report()}"
    assert lines == _variant_lines(_part(launches["gloo"], "VARIANTS"))
