"""The engine's choice between plain and non-temporal stores (csrc/shm/copy.c), driven call by
call with made-up costs by a small C program (tests/native/scripts/stores_choice.c says what
each check expects): the choice itself is timing-free, so it is tested without timing anything."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from ranks import ROOT


@pytest.mark.timeout(60)
def test_the_store_choice_follows_the_placement_and_not_the_load(tmp_path):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    program = tmp_path / "stores_choice"
    subprocess.run(["cc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-I", os.path.join(ROOT, "csrc", "shm"),
                    os.path.join(ROOT, "csrc", "shm", "copy.c"),
                    os.path.join(ROOT, "tests", "native", "scripts", "stores_choice.c"), "-o", str(program)],
                   check=True, timeout=50)
    proc = subprocess.run([str(program)], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0 and "FAILED" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 7, proc.stdout
