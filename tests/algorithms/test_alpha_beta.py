"""benchmarks/alpha_beta.py: the model's step and byte counts, and its fit to the measured
netns figures kept beside it (benchmarks/measured_netns.json)."""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import alpha_beta  # noqa: E402


def test_step_counts_match_the_schedules() -> None:
    assert alpha_beta.terms("rd", 8, 4)[0] == 3
    assert alpha_beta.terms("rd", 6, 4)[0] == 4          # folded: 2 + 2
    assert alpha_beta.terms("rh", 16, 1 << 20)[0] == 8
    assert alpha_beta.terms("ring", 8, 4)[0] == 7        # the one-pass path
    assert alpha_beta.terms("ring", 8, 1 << 20)[0] == 14  # reduce-scatter + all-gather


def test_each_host_counts_fit_explains_its_figures_within_a_factor_of_two() -> None:
    with open(os.path.join(ROOT, "benchmarks", "measured_netns.json")) as f:
        points = json.load(f)
    for hosts in {pt["hosts"] for pt in points}:
        group = [pt for pt in points if pt["hosts"] == hosts]
        alpha, beta = alpha_beta.fit(group, 0.0)
        assert alpha > 0 and beta > 0
        for pt in group:
            ratio = alpha_beta.model_us(pt["schedule"], hosts, pt["bytes"], alpha, beta, 0.0) / pt["us"]
            assert 0.5 < ratio < 2.0, (pt, ratio)


def test_at_scale_the_model_prefers_log_latency_for_small_messages(capsys) -> None:
    assert alpha_beta.main([]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1024 | 4 B")]
    assert rows and rows[0].endswith("| rd |")
