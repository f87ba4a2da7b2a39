"""average_gradients over a real ring of 2 and 3 processes on loopback.

One launch per group size runs every check (each rank builds its own inputs from its rank,
so it can compute the expected average alone); the tests judge each check's outcome.
Run as a script, this file is the per-rank worker.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import OrderedDict, namedtuple
from pathlib import Path

import numpy as np
import pytest
import zygote
from ranks import free_ports, run_checks

from adapter.gradients import average_gradients

REPO = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 60
CHECKS: dict = {}
Pair = namedtuple("Pair", "weight bias")


# ---- launching -----------------------------------------------------------------------------

def launch(ranks: int, tmp: Path, *args: str) -> list[subprocess.CompletedProcess]:
    """Run this file as `ranks` ring ranks; return each rank's completed process."""
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(ranks)]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "OMPI_", "PMIX_"))}
    env.update(MLX_HOSTFILE=str(hostfile), JACKLRING_TIMEOUT="20", JACKLRING_CONNECT_TIMEOUT="20",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]), OMP_NUM_THREADS="1")
    procs = [
        zygote.popen([sys.executable, __file__, *args], env={**env, "MLX_RANK": str(r)}, cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(ranks)
    ]
    done = []
    try:
        for r, proc in enumerate(procs):
            out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def outcomes(request, tmp_path_factory) -> dict:
    ranks = request.param
    tmp = tmp_path_factory.mktemp(f"grad{ranks}")
    procs = launch(ranks, tmp, str(tmp))
    per_rank = []
    for r, proc in enumerate(procs):
        path = tmp / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no results (exit {proc.returncode}):\n{proc.stdout}"
        per_rank.append(json.loads(path.read_text()))
    return {"ranks": ranks, "per_rank": per_rank}


# ---- the checks (run inside each rank) -------------------------------------------------------

def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def values(rank: int, shape, dtype, salt: int = 0) -> np.ndarray:
    """This rank's deterministic input for one leaf (float64, cast by the caller)."""
    rng = np.random.default_rng(1000 * salt + rank)
    return rng.standard_normal(shape).astype(dtype)


def expected(n: int, shape, dtype, salt: int = 0) -> np.ndarray:
    return np.mean([values(r, shape, dtype, salt).astype(np.float64) for r in range(n)], axis=0)


def to_float64(x) -> np.ndarray:
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6, "float64": 1e-12}


def assert_close(got, want, dtype_name: str, what: str) -> None:
    tol = TOLERANCE[dtype_name]
    got64 = to_float64(got)
    assert got64.shape == want.shape, f"{what}: shape {got64.shape} != {want.shape}"
    np.testing.assert_allclose(got64, want, rtol=tol, atol=tol, err_msg=what)


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


@check
def nested_torch_every_float_dtype(ctx):
    import torch

    r, n = ctx["rank"], ctx["size"]
    names = ["float32", "float16", "bfloat16", "float64"]
    tree = {
        name: [torch.from_numpy(values(r, (3, 5), np.float64, i)).to(torch_dtype(name)),
               (torch.from_numpy(values(r, (7,), np.float64, 10 + i)).to(torch_dtype(name)),)]
        for i, name in enumerate(names)
    }
    for size in (64, 10**6, 0):  # many buckets, one bucket per dtype, one message per leaf
        out = average_gradients(tree, all_reduce_size=size)
        assert list(out) == names and isinstance(out["float32"], list) and isinstance(out["float32"][1], tuple)
        for i, name in enumerate(names):
            a, (b,) = out[name]
            assert a.dtype == torch_dtype(name) and b.dtype == torch_dtype(name)
            assert_close(a, expected(n, (3, 5), np.float64, i), name, f"{name} a size={size}")
            assert_close(b, expected(n, (7,), np.float64, 10 + i), name, f"{name} b size={size}")


@check
def numpy_containers_and_input_untouched(ctx):
    from adapter.backends.elements import BFLOAT16

    r, n = ctx["rank"], ctx["size"]
    tree = OrderedDict(
        w=values(r, (4, 4), np.float32, 1),
        pair=Pair(values(r, (2, 3), np.float64, 2), values(r, (), np.float32, 3)),
        bf=values(r, (5,), np.float64, 4).astype(BFLOAT16),
        scalar=np.float32(values(r, (), np.float64, 5)),
        nothing=None,
        empty=np.zeros((0, 3), np.float32),
        strided=values(r, (6, 4), np.float32, 6)[:, ::2],
    )
    before = {k: np.array(v, copy=True) for k, v in tree.items() if v is not None and not isinstance(v, tuple)}
    out = average_gradients(tree, all_reduce_size=48)
    assert type(out) is OrderedDict and list(out) == list(tree)
    assert type(out["pair"]) is Pair and out["nothing"] is None
    assert_close(out["w"], expected(n, (4, 4), np.float32, 1), "float32", "w")
    assert_close(out["pair"].weight, expected(n, (2, 3), np.float64, 2), "float64", "pair.weight")
    assert_close(out["pair"].bias, expected(n, (), np.float32, 3), "float32", "pair.bias")
    assert out["bf"].dtype == BFLOAT16
    assert_close(out["bf"], expected(n, (5,), np.float64, 4), "bfloat16", "bf")
    assert isinstance(out["scalar"], np.float32)
    assert_close(out["scalar"], expected(n, (), np.float64, 5), "float32", "scalar")
    assert out["empty"].shape == (0, 3)
    assert_close(out["strided"], expected(n, (6, 4), np.float32, 6)[:, ::2], "float32", "strided")
    for k, v in before.items():
        np.testing.assert_array_equal(np.asarray(tree[k]), v, err_msg=f"input {k} was modified")


@check
def mixed_torch_and_numpy_in_one_tree(ctx):
    import torch

    r, n = ctx["rank"], ctx["size"]
    tree = [torch.from_numpy(values(r, (9,), np.float32, 1)), values(r, (9,), np.float32, 2),
            torch.from_numpy(values(r, (2, 2), np.float64, 3)).to(torch.bfloat16)]
    tree.append(values(r, (4,), np.float64, 4) + 1j * values(r, (4,), np.float64, 5))
    out = average_gradients(tree)
    assert isinstance(out[0], torch.Tensor) and isinstance(out[1], np.ndarray) and out[2].dtype == torch.bfloat16
    want = expected(n, (4,), np.float64, 4) + 1j * expected(n, (4,), np.float64, 5)
    np.testing.assert_allclose(out[3], want, rtol=1e-12, err_msg="complex128 leaf")
    assert_close(out[0], expected(n, (9,), np.float32, 1), "float32", "torch leaf")
    assert_close(out[1], expected(n, (9,), np.float32, 2), "float32", "numpy leaf")
    assert_close(out[2], expected(n, (2, 2), np.float64, 3), "bfloat16", "bf16 leaf")


@check
def equals_per_tensor_averaging(ctx):
    """Packed averaging agrees with one all_sum per tensor divided by the group size."""
    import adapter

    r, n = ctx["rank"], ctx["size"]
    tree = [values(r, (s,), np.float32, s) for s in (1, 7, 300, 5000, 20000, 3)]
    packed = average_gradients(tree, all_reduce_size=4096)
    for x, got in zip(tree, packed):
        want = adapter.all_sum(x) / n
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@check
def reused_buffers_never_overwrite_held_results(ctx):
    """Buffers are recycled between calls only once the caller has dropped every result."""
    import torch

    r, n = ctx["rank"], ctx["size"]
    first = [torch.from_numpy(values(r, (50,), np.float32, 1)), values(r, (50,), np.float32, 2)]
    second = [torch.from_numpy(values(r, (50,), np.float32, 3)), values(r, (50,), np.float32, 4)]
    held = average_gradients(first)
    for _ in range(3):
        average_gradients(second)  # results dropped at once: these may share one buffer
    kept_view = average_gradients(second)[0][10:20]  # a slice alone keeps its buffer busy
    average_gradients(first)
    assert_close(held[0], expected(n, (50,), np.float32, 1), "float32", "held torch result")
    assert_close(held[1], expected(n, (50,), np.float32, 2), "float32", "held numpy result")
    assert_close(kept_view, expected(n, (50,), np.float32, 3)[10:20], "float32", "held slice of a result")


@check
def large_leaf_travels_alone(ctx):

    r, n = ctx["rank"], ctx["size"]
    big = values(r, (300, 100), np.float32, 1)
    small = values(r, (10,), np.float32, 2)
    out = average_gradients({"small": small, "big": big, "small2": small * 2}, all_reduce_size=1024)
    assert_close(out["big"], expected(n, (300, 100), np.float32, 1), "float32", "big")
    assert_close(out["small2"], 2 * expected(n, (10,), np.float32, 2), "float32", "small2")


@check
def module_grads_in_place(ctx):
    import torch

    import adapter

    r = ctx["rank"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 300), torch.nn.Tanh(), torch.nn.Linear(300, 4), torch.nn.Linear(4, 2))
    model[3].weight.requires_grad_(False)  # a parameter without a gradient is skipped
    model[3].bias.grad = None
    x = torch.from_numpy(values(r, (8, 6), np.float32, 1))
    model(x).square().sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    local = {name: g.clone() for name, g in grads.items()}
    everyone = adapter.all_gather(torch.stack([torch.cat([g.reshape(-1) for g in local.values()])]))
    want = everyone.to(torch.float64).mean(0)
    # 1200 float32 bytes: the 300x6 weight travels alone and in place, the rest is packed.
    result = average_gradients(model, all_reduce_size=1200 * 4)
    assert result is model
    got = torch.cat([p.grad.reshape(-1) for name, p in model.named_parameters() if p.grad is not None])
    for name, p in model.named_parameters():
        if name in grads:
            assert p.grad is grads[name], f"{name}: .grad was replaced instead of updated in place"
    assert model[3].weight.grad is None
    np.testing.assert_allclose(got.to(torch.float64).numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


@check
def module_grads_keep_their_memory_across_steps(ctx):
    """Large gradients come back sharing the packed buffer: a later backward that accumulates
    into them, a second model averaged meanwhile and a list result held from before must all
    keep their own values; a channels_last gradient keeps its layout."""
    import torch

    import adapter

    r, n = ctx["rank"], ctx["size"]

    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3), torch.nn.Flatten(), torch.nn.Linear(16 * 6 * 6, 32))

    def step(model: torch.nn.Module, seed: int) -> None:
        x = torch.from_numpy(values(r, (2, 8, 8, 8), np.float32, seed))
        model(x).square().sum().backward()

    def mean_of(model: torch.nn.Module) -> torch.Tensor:
        local = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).to(torch.float64)
        return adapter.all_gather(local.reshape(1, -1)).mean(0)

    first, second = build(0), build(1)
    first[0].weight.grad = torch.zeros_like(first[0].weight, memory_format=torch.channels_last)
    held = average_gradients([torch.from_numpy(values(r, (5000,), np.float32, 9))])
    for round_ in range(3):
        step(first, round_)  # accumulates into the gradients averaged the round before
        step(second, round_ + 10)
        want_first, want_second = mean_of(first), mean_of(second)
        ids = [id(p.grad) for p in first.parameters()]
        average_gradients(first)
        average_gradients(second)
        assert [id(p.grad) for p in first.parameters()] == ids, "a .grad was replaced"
        for model, want, name in ((first, want_first, "first"), (second, want_second, "second")):
            got = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).to(torch.float64)
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{name}, round {round_}")
        assert first[0].weight.grad.is_contiguous(memory_format=torch.channels_last), "layout changed"
    assert_close(held[0], expected(n, (5000,), np.float32, 9), "float32", "list result held meanwhile")


@check
def communication_type_casts_for_the_wire(ctx):
    import torch

    r, n = ctx["rank"], ctx["size"]
    tree = {"a": torch.from_numpy(values(r, (40,), np.float32, 1)), "b": values(r, (3, 3), np.float64, 2)}
    for wire, name in ((torch.bfloat16, "bfloat16"), ("float16", "float16"), (np.float16, "float16")):
        out = average_gradients(tree, communication_type=wire)
        assert out["a"].dtype == torch.float32 and out["b"].dtype == np.float64
        assert_close(out["a"], expected(n, (40,), np.float32, 1), name, f"a over {name}")
        assert_close(out["b"], expected(n, (3, 3), np.float64, 2), name, f"b over {name}")
        # The values really were rounded to the wire type (not sent at full precision).
        wire_np = np.float16 if name == "float16" else None
        if wire_np is not None:
            back = np.asarray(out["b"]).astype(np.float16).astype(np.float64)
            np.testing.assert_array_equal(np.asarray(out["b"]), back)
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.from_numpy(values(r, (2, 3), np.float32, 3))
    model.bias.grad = torch.from_numpy(values(r, (2,), np.float32, 4))
    average_gradients(model, communication_type="bfloat16")
    assert model.weight.grad.dtype == torch.float32
    assert_close(model.weight.grad, expected(n, (2, 3), np.float32, 3), "bfloat16", "module weight over bf16")


@check
def packs_into_few_messages(ctx):
    """One all_reduce per (dtype, ~all_reduce_size bytes), counted on the real backend."""
    import torch

    import adapter

    group = adapter.init()
    sizes = []
    real = group.backend.all_reduce

    def counting(src, dst, op):
        sizes.append((src.dtype.name, src.size))
        return real(src, dst, op)

    group.backend.all_reduce = counting
    try:
        r = ctx["rank"]
        tree = [values(r, (10,), np.float32, i) for i in range(200)]
        tree += [torch.ones(10, dtype=torch.float16) for _ in range(50)]
        average_gradients(tree)
        assert sorted(sizes) == [("float16", 500), ("float32", 2000)], sizes
        sizes.clear()
        average_gradients(tree[:200], all_reduce_size=400 * 4)
        assert sizes == [("float32", 400)] * 5, sizes
        sizes.clear()
        average_gradients(tree[:20], all_reduce_size=0)
        assert sizes == [("float32", 10)] * 20, sizes
    finally:
        del group.backend.all_reduce


@check
def torch_tensors_of_one_dtype_every_shape(ctx):
    """The usual input (torch tensors sharing a dtype and device) in every shape, layout and
    bucket split: 1-D, 2-D, 0-d, empty, non-contiguous, requiring grad, and one leaf large
    enough to be scaled while it is packed, with one bucket and with many."""
    import torch

    from adapter.gradient_packing import FUSED_SCALE_ELEMENTS

    r, n = ctx["rank"], ctx["size"]
    shapes = [(7,), (3, 4), (), (0,), (2, 3, 5), (FUSED_SCALE_ELEMENTS + 3,), (1,), (6, 2)]
    for dtype in ("float32", "float16"):
        tree = [torch.from_numpy(values(r, s, np.float64, i)).to(torch_dtype(dtype)) for i, s in enumerate(shapes)]
        tree[1] = tree[1].t()  # non-contiguous: a (4, 3) transpose
        tree[6].requires_grad_(True)
        before = [x.detach().clone() for x in tree]
        itemsize = tree[0].element_size()
        for size in (10**8, 40 * itemsize, 0):  # one bucket, several, one message per leaf
            out = average_gradients(tree, all_reduce_size=size)
            assert type(out) is list and len(out) == len(tree)
            for i, (x, got) in enumerate(zip(tree, out)):
                want = expected(n, shapes[i], np.float64, i)
                if i == 1:
                    want = want.T
                assert got.shape == x.shape and got.dtype == x.dtype, (i, got.shape, got.dtype)
                assert_close(got.detach(), want, dtype, f"{dtype} leaf {i} {tuple(x.shape)} size={size}")
            for i, (x, old) in enumerate(zip(tree, before)):
                assert torch.equal(x.detach(), old), f"input leaf {i} was modified"


@check
def errors_name_the_leaf(ctx):

    import torch

    cases = (({"steps": np.arange(3)}, ["steps", "int64"]), ({"x": "text"}, ["x", "str"]),
             ([torch.arange(3), torch.arange(2)], ["[0]", "int64"]), ([torch.ones(2), "text"], ["[1]", "str"]))
    for bad, words in cases:
        try:
            average_gradients(bad)
        except TypeError as exc:
            assert all(w in str(exc) for w in words), str(exc)
        else:
            raise AssertionError(f"{bad} was accepted")


def worker(out_dir: str) -> None:
    run_checks(CHECKS, out_dir)


# ---- the tests ---------------------------------------------------------------------------------

@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", list(CHECKS))
def test_check(outcomes, name: str) -> None:
    failures = [f"rank {r}:\n{res.get(name, 'did not run')}" for r, res in enumerate(outcomes["per_rank"])
                if res.get(name) != "ok"]
    assert not failures, "\n".join(failures)


def test_group_of_one_returns_input_untouched() -> None:
    import torch

    import adapter
    from adapter.backends.singleton import SingletonBackend

    alone = adapter.Group(SingletonBackend())
    tree = {"w": torch.ones(3), "v": [np.zeros(2)]}
    assert average_gradients(tree, group=alone) is tree
    model = torch.nn.Linear(2, 2)
    assert average_gradients(model, group=alone) is model


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    worker(sys.argv[1])
