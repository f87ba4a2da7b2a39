"""Pictures: `python -m adapter.bench --plot FILE` draws every system of the run (time and busbw
against size, log-log), and says what it wrote. The data-parallel example's closing summary
and --plot are checked with its runs (tests/repository/test_examples.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


@pytest.mark.timeout(150)
def test_bench_plot_draws_one_line_per_system_log_log(tmp_path):
    pytest.importorskip("matplotlib")  # the test extra has it
    out = tmp_path / "allsum.svg"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "JACKLRING_"))}
    r = subprocess.run([sys.executable, "-m", "adapter.bench", "-n", "2", "--backend", "ring,ring-tcp",
                        "--sizes", "4,4K,256K", "--rounds", "2", "--iters", "3", "--plot", str(out)],
                       capture_output=True, text=True, timeout=130, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"bench: wrote {out}" in r.stderr, r.stderr
    svg = out.read_text()
    texts = re.findall(r"<text[^>]*>([^<]*)</text>", svg)
    # the legends (one per panel) name every system; the axes say what they show
    assert texts.count("ring") == 2 and texts.count("ring-tcp") == 2, texts
    assert any("busbw" in t for t in texts) and any("time per all_sum" in t for t in texts), texts
    assert [t for t in texts if t in ("4", "4K", "256K")].count("4K") == 2, texts  # the sizes are the ticks
    # log-log: one data line per system and panel, each through the 3 sizes measured
    lines = re.findall(r'<path d="M ([^"]*)"[^>]*clip-path', svg)
    three_points = [d for d in lines if len(re.findall(r"[ML] ", "M " + d)) == 3]
    assert len(three_points) >= 4, lines[:8]


def test_bench_without_matplotlib_says_what_to_install(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from adapter.bench_plot import plot_results\n"
            "plot_results('x.png', {}, [], [4], 2)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode != 0 and "pip install 'jacklring[plot]'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
