"""The training examples end to end: N ranks under the launcher reach what one process reaches.

The data-parallel example is the README's main job (`launcher -n 4 examples/training/data_parallel.py`);
each run saves its final parameters (--save) and the tests compare the files.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import zygote

pytest.importorskip("torch")
# Looked up, not imported: every xdist worker collects this file, and importing scikit-learn
# (scipy with it) costs seconds of CPU that only the worker running these tests needs.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                                reason="the examples' data set ships with scikit-learn (pip install jacklring[examples])")

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "training"
RUN_TIMEOUT_S = 120


def clean_env() -> dict[str, str]:
    """No inherited distributed configuration: one process is a group of one."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLX_", "OMPI_", "PMIX_", "NCCL_", "JACKLRING_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), JACKLRING_TIMEOUT="30", OMP_NUM_THREADS="1")
    return env


def run(command: list[str], start: Callable = subprocess.Popen) -> str:
    proc = start(command, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(command)} still running after {RUN_TIMEOUT_S} s:\n{out}{err}")
    output = out + err
    assert proc.returncode == 0, f"{' '.join(command)} failed ({proc.returncode}):\n{output}"
    return output


def alone(script: str, *args: str) -> str:
    """The one-process reference run, forked from the zygote (torch imported once per worker):
    these tests are about the launched runs matching it, not about a fresh interpreter."""
    return run([sys.executable, str(EXAMPLES / script), *args], start=zygote.popen)


def launched(ranks: int, script: str, *args: str) -> str:
    # The launcher as installed (the console script beside this python), as the README runs it.
    launcher = Path(sys.executable).with_name("launcher")
    prefix = [str(launcher)] if launcher.exists() else [sys.executable, "-c", "from launcher.cli import main; main()"]
    return run([*prefix, "-n", str(ranks), str(EXAMPLES / script), *args])


def assert_same_parameters(a: Path, b: Path, atol: float) -> None:
    one, many = np.load(a), np.load(b)
    assert sorted(one) == sorted(many)
    for name in one:
        assert one[name].shape == many[name].shape, name
        np.testing.assert_allclose(many[name], one[name], rtol=0, atol=atol, err_msg=name)


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 30)
def test_data_parallel_on_4_ranks_matches_one_process_and_learns(tmp_path: Path) -> None:
    out1 = alone("data_parallel.py", "--save", str(tmp_path / "one.npz"))
    out4 = launched(4, "data_parallel.py", "--save", str(tmp_path / "four.npz"))
    assert "4 rank(s), adapter.average_gradients" in out4
    accuracies = [float(a) for a in re.findall(r"epoch +\d+ +loss [\d.]+ +test accuracy ([\d.]+)%", out4)]
    assert len(accuracies) == 12 and accuracies[-1] > 90, out4
    assert re.findall(r"loss [\d.]+", out1) == re.findall(r"loss [\d.]+", out4)
    assert_same_parameters(tmp_path / "one.npz", tmp_path / "four.npz", atol=1e-5)


SHORT = ("--epochs", "2", "--global-batch", "50")  # 50 splits unevenly: 17, 17, 16 on 3 ranks


@pytest.fixture(scope="module")
def short_reference(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dp") / "one.npz"
    alone("data_parallel.py", *SHORT, "--save", str(path))
    return path


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_data_parallel_uneven_shards_on_3_ranks(short_reference: Path, tmp_path: Path) -> None:
    plot = tmp_path / "curves.png"
    out = launched(3, "data_parallel.py", *SHORT, "--save", str(tmp_path / "three.npz"), "--plot", str(plot))
    assert_same_parameters(short_reference, tmp_path / "three.npz", atol=1e-5)
    # the closing summary: total time, samples per second, final accuracy (the last epoch's)
    summary = re.search(r"\[0\] done: 2 epochs in ([\d.]+) s, ([\d,]+) samples/s over 3 rank\(s\), "
                        r"final loss [\d.]+, final test accuracy ([\d.]+)%", out)
    assert summary, out
    seconds, rate = float(summary[1]), float(summary[2].replace(",", ""))
    # samples/s is the samples over the time shown, within the rounding of that time
    assert 3000 / (seconds + 0.006) <= rate <= 3000 / max(seconds - 0.006, 1e-9), out
    assert re.findall(r"epoch +\d+ +loss [\d.]+ +test accuracy ([\d.]+)%", out)[-1] == summary[3], out
    if importlib.util.find_spec("matplotlib") is not None:
        assert f"wrote the loss and accuracy curves to {plot}" in out, out
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_data_parallel_ddp_over_jacklring_matches(short_reference: Path, tmp_path: Path) -> None:
    out = launched(2, "data_parallel.py", *SHORT, "--ddp", "--save", str(tmp_path / "ddp.npz"))
    assert "2 rank(s), DDP over jacklring" in out
    assert_same_parameters(short_reference, tmp_path / "ddp.npz", atol=1e-5)


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 30)
def test_tensor_parallel_losses_match_the_unsharded_run(tmp_path: Path) -> None:
    args = ("--steps", "15")
    alone("tensor_parallel.py", *args, "--save", str(tmp_path / "one.npz"))
    out = launched(2, "tensor_parallel.py", *args, "--save", str(tmp_path / "two.npz"))
    assert "96 per rank" in out  # (3 ranks are covered by tests/api/test_parallel.py)
    one, two = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    assert len(one["losses"]) == 15 and one["losses"][-1] < one["losses"][0]
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    assert_same_parameters(tmp_path / "one.npz", tmp_path / "two.npz", atol=1e-5)


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_elastic_training_survives_a_kill_and_finishes_with_identical_parameters():
    output = run([sys.executable, str(EXAMPLES / "elastic.py"), "--spawn", "3", "--kill", "1:5", "--epochs", "1"])
    assert "shrunk to 2 rank(s)" in output, output
    assert output.count("parameters identical on every rank: True") == 2, output
    assert "exit codes [0, -9, 0]" in output, output


def test_the_examples_read_the_digits_load_digits_returns():
    """The examples read scikit-learn's digits file themselves (importing sklearn.datasets costs
    every rank a lot of imports); the arrays must be load_digits()'s."""
    from sklearn.datasets import load_digits

    spec = importlib.util.spec_from_file_location("digits", EXAMPLES / "digits.py")
    digits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits)
    pixels, labels = digits.load_digits()
    reference = load_digits()
    np.testing.assert_array_equal(pixels, reference.data)
    np.testing.assert_array_equal(labels, reference.target)
    assert pixels.dtype == reference.data.dtype and labels.dtype == reference.target.dtype
