"""The engine's timing-free decisions, each driven by a small C program with made-up inputs
(tests/native/scripts/ says what each check expects), so they are tested without timing anything:
the choice between plain and non-temporal stores (csrc/shm/copy.c), and when waits stop yielding
because work outside the job fills the CPUs (csrc/shm/crowding.c)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from ranks import ROOT


def run_checks(tmp_path, unit: str, script: str) -> str:
    """Builds csrc/shm/<unit>.c with tests/native/scripts/<script>.c, runs it; returns its output."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    program = tmp_path / script
    subprocess.run(["cc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-I", os.path.join(ROOT, "csrc", "shm"),
                    os.path.join(ROOT, "csrc", "shm", f"{unit}.c"),
                    os.path.join(ROOT, "tests", "native", "scripts", f"{script}.c"), "-o", str(program)],
                   check=True, timeout=50)
    proc = subprocess.run([str(program)], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0 and "FAILED" not in proc.stdout, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.timeout(60)
def test_the_store_choice_follows_the_placement_and_not_the_load(tmp_path):
    out = run_checks(tmp_path, "copy", "stores_choice")
    assert out.count("ok ") == 7, out


@pytest.mark.timeout(60)
def test_waits_stop_yielding_only_when_outside_work_fills_the_cpus(tmp_path):
    """After a long sched_yield, with more ranks than CPUs, the waits read /proc/loadavg's runnable
    count; they sleep at once for a while only when tasks besides the awake ranks fill the CPUs."""
    out = run_checks(tmp_path, "crowding", "crowding")
    assert out.count("ok ") == 14, out
