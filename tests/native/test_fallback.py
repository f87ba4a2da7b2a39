"""Without the native engine (hidden from import, as after JACKLRING_NO_NATIVE=1 at install),
a same-host job still runs and gives right results over its sockets, with one warning line per
process, and never an import error."""
from __future__ import annotations

import os

import pytest
from ranks import ROOT, launch

HIDE = '''
import importlib.abc, sys

class _HideEngine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "adapter.backends.local._engine":
            raise ImportError("hidden by the test")
        return None

sys.meta_path.insert(0, _HideEngine())
'''


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
def test_a_job_without_the_engine_runs_over_sockets_and_warns_once(tmp_path, backend):
    (tmp_path / "sitecustomize.py").write_text(HIDE)
    script = os.path.join(ROOT, "tests", "native", "scripts", "without_engine.py")
    proc = launch(["-n", "2", "--backend", backend, script], timeout=140,
                  env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert output.count("ok without the engine") == 2, output
    warnings = [line for line in output.splitlines() if "ranks on one host use sockets" in line]
    assert len(warnings) == 2, output  # one line per rank process, not one per collective
    assert "hidden by the test" in warnings[0], warnings
