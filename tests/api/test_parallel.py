"""Tensor-parallel layers over a real ring of 2 and 3 processes: forward values and every
gradient of the sharded layers equal the matching block of the unsharded layer's.

Every rank builds the full layer from the same seed, so it can compute the unsharded
reference alone and compare its own block. Run as a script, this file is the per-rank worker.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zygote
from ranks import free_ports, run_checks

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 60
CHECKS: dict = {}
D = 12  # feature sizes are multiples of 6, so 2 and 3 ranks divide them


def launch(ranks: int, tmp: Path) -> list[str]:
    """Run this file as `ranks` ring ranks; return each rank's output."""
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(ranks)]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "OMPI_", "PMIX_"))}
    env.update(MLX_HOSTFILE=str(hostfile), JACKLRING_TIMEOUT="20", JACKLRING_CONNECT_TIMEOUT="20",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]), OMP_NUM_THREADS="1")
    procs = [zygote.popen([sys.executable, __file__, str(tmp)], env={**env, "MLX_RANK": str(r)}, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(ranks)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=LAUNCH_TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


# 3 ranks (uneven powers, middle ranks); 2 ranks run in tests/repository/test_examples.py's tensor-parallel job.
@pytest.fixture(scope="module", params=[3], ids=lambda n: f"{n}ranks")
def outcomes(request, tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp(f"parallel{request.param}")
    outputs = launch(request.param, tmp)
    per_rank = []
    for r, output in enumerate(outputs):
        path = tmp / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no results:\n{output}"
        per_rank.append(json.loads(path.read_text()))
    return per_rank


# ---- the checks (run inside each rank) ---------------------------------------------------------

def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def block(x, axis: int, n: int, r: int, segments: int = 1):
    """Rank r's block of each of the segments of x along axis, concatenated."""
    return torch.cat([part.chunk(n, axis)[r] for part in x.chunk(segments, axis)], axis)


def seeded_linear(inp: int, out: int, bias: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Linear(inp, out, bias=bias)


@check
def all_to_sharded_forward_and_backward(ctx):
    from adapter.parallel import AllToShardedLinear, shard_linear

    n, r = ctx["size"], ctx["rank"]
    for bias, segments in ((True, 1), (False, 1), (True, 3), (True, [D, 2 * D]), (True, [1 / 3, 2 / 3])):
        parts = 3 if segments != 1 else 1
        full = seeded_linear(D, 3 * D, bias)
        torch.manual_seed(1)
        x = torch.randn(5, D, requires_grad=True)
        c = torch.randn(5, 3 * D)  # the loss weights every output feature differently
        (full(x) * c).sum().backward()

        layer = shard_linear(full, "all-to-sharded", segments=segments)
        assert isinstance(layer, AllToShardedLinear) and layer.weight.shape == (3 * D // n, D)
        x2 = x.detach().clone().requires_grad_(True)
        y = layer(x2)
        what = f"bias={bias} segments={segments}"
        close(y, block(full(x).detach(), 1, n, r, parts), f"output {what}")
        # The full loss is the sum of the ranks' partial losses.
        (y * block(c, 1, n, r, parts)).sum().backward()
        close(x2.grad, x.grad, f"input gradient (summed over ranks) {what}")
        close(layer.weight.grad, block(full.weight.grad, 0, n, r, parts), f"weight gradient {what}")
        if bias:
            close(layer.bias.grad, block(full.bias.grad, 0, n, r, parts), f"bias gradient {what}")
        else:
            assert layer.bias is None


@check
def sharded_to_all_forward_and_backward(ctx):
    from adapter.parallel import ShardedToAllLinear, shard_linear

    n, r = ctx["size"], ctx["rank"]
    for bias, segments in ((True, 1), (False, 1), (True, 2)):
        full = seeded_linear(2 * D, D, bias)
        torch.manual_seed(2)
        x = torch.randn(4, 2 * D, requires_grad=True)
        c = torch.randn(4, D)
        want = full(x)
        (want * c).sum().backward()

        layer = shard_linear(full, "sharded-to-all", segments=segments)
        assert isinstance(layer, ShardedToAllLinear) and layer.weight.shape == (D, 2 * D // n)
        x_block = block(x.detach(), 1, n, r, segments).requires_grad_(True)
        y = layer(x_block)
        what = f"bias={bias} segments={segments}"
        close(y, want.detach(), f"output (summed over ranks, bias once) {what}")
        (y * c).sum().backward()  # every rank computes the same loss
        close(x_block.grad, block(x.grad, 1, n, r, segments), f"input gradient {what}")
        close(layer.weight.grad, block(full.weight.grad, 1, n, r, segments), f"weight gradient {what}")
        if bias:
            close(layer.bias, full.bias.detach(), "bias kept whole")
            close(layer.bias.grad, full.bias.grad, f"bias gradient {what}")


@check
def mlp_block_training_step_matches_unsharded(ctx):
    """up (all-to-sharded) -> gelu -> down (sharded-to-all): outputs, losses and the parameters
    after three SGD steps equal the unsharded MLP's blocks."""
    from adapter.parallel import shard_linear

    n, r = ctx["size"], ctx["rank"]
    up, down = seeded_linear(D, 4 * D, seed=3), seeded_linear(4 * D, D, seed=4)
    s_up, s_down = shard_linear(up, "all-to-sharded"), shard_linear(down, "sharded-to-all")
    full_opt = torch.optim.SGD([*up.parameters(), *down.parameters()], lr=0.1)
    shard_opt = torch.optim.SGD([*s_up.parameters(), *s_down.parameters()], lr=0.1)
    torch.manual_seed(5)
    for step in range(3):
        x, target = torch.randn(8, D), torch.randn(8, D)
        for model, opt in (((up, down), full_opt), ((s_up, s_down), shard_opt)):
            opt.zero_grad()
            h = x.requires_grad_(False)
            loss = torch.nn.functional.mse_loss(x + model[1](torch.nn.functional.gelu(model[0](h))), target)
            loss.backward()
            opt.step()
            if model[0] is up:
                want_loss = loss.item()
            else:
                assert abs(loss.item() - want_loss) < 1e-5, f"step {step}: loss {loss.item()} != {want_loss}"
    close(s_up.weight.detach(), block(up.weight.detach(), 0, n, r), "up weight after training")
    close(s_up.bias.detach(), block(up.bias.detach(), 0, n, r), "up bias after training")
    close(s_down.weight.detach(), block(down.weight.detach(), 1, n, r), "down weight after training")
    close(s_down.bias.detach(), down.bias.detach(), "down bias after training")


@check
def shard_inplace_keeps_the_module_and_takes_rules(ctx):
    from adapter.parallel import shard_inplace

    n, r = ctx["size"], ctx["rank"]
    full = seeded_linear(D, 2 * D)
    layer = seeded_linear(D, 2 * D)
    weight_param = layer.weight
    shard_inplace(layer, "all-to-sharded", segments=2)
    assert layer.weight is weight_param, "the Parameter object was replaced"
    close(layer.weight.detach(), block(full.weight.detach(), 0, n, r, 2), "weight")
    close(layer.bias.detach(), block(full.bias.detach(), 0, n, r, 2), "bias")
    layer = seeded_linear(D, 2 * D)
    shard_inplace(layer, "sharded-to-all")
    close(layer.weight.detach(), block(full.weight.detach(), 1, n, r), "sharded-to-all weight")
    close(layer.bias.detach(), full.bias.detach(), "sharded-to-all bias untouched")
    layer = seeded_linear(D, 2 * D)
    shard_inplace(layer, lambda name, w: 0 if name == "weight" else None)
    close(layer.weight.detach(), block(full.weight.detach(), 0, n, r), "custom rule weight")
    close(layer.bias.detach(), full.bias.detach(), "custom rule bias")


@check
def bad_arguments_raise(ctx):
    from adapter.parallel import AllToShardedLinear, ShardedToAllLinear, shard_linear

    n = ctx["size"]
    for build in (lambda: AllToShardedLinear(4, n * 2 + 1), lambda: ShardedToAllLinear(n * 2 + 1, 4),
                  lambda: shard_linear(torch.nn.Linear(6, 6), "rows"),
                  lambda: shard_linear(torch.nn.Linear(6, 6), "all-to-sharded", segments=4)):
        try:
            build()
        except ValueError:
            continue
        raise AssertionError("accepted a bad argument")


def worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    run_checks(CHECKS, out_dir)


# ---- the tests ---------------------------------------------------------------------------------

@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", list(CHECKS))
def test_check(outcomes, name: str) -> None:
    failures = [f"rank {r}:\n{res.get(name, 'did not run')}" for r, res in enumerate(outcomes) if res.get(name) != "ok"]
    assert not failures, "\n".join(failures)


def test_group_of_one_is_the_plain_linear() -> None:
    import adapter
    from adapter.backends.singleton import SingletonBackend
    from adapter.parallel import shard_linear

    alone = adapter.Group(SingletonBackend())
    full = seeded_linear(6, 4)
    x = torch.randn(3, 6)
    for sharding in ("all-to-sharded", "sharded-to-all"):
        close(shard_linear(full, sharding, group=alone)(x), full(x), sharding)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    worker(sys.argv[1])
