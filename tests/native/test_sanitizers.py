"""The engine built with AddressSanitizer and UndefinedBehaviorSanitizer (into a temporary
directory, loaded in place of the installed one) runs the engine's results tests (every dtype,
op and path, members as threads), the backend contract's checks on a 3-rank ring job and a
2-rank JACCL job (whose collectives all run over shared memory) and a randomized stress of a 3-rank job that ends in a
kill: any sanitizer report fails the test (halt_on_error, exit code). The build always uses
non-temporal stores for large messages (JL_STORES_FORCE=1), so that every large path streams
here; the plain path is the installed build's default in the near placement."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy
import pytest
from contract.backends import DATA_PATH, VARIANTS
from ranks import ROOT, launch, output_tail, run

LOADER = '''
import importlib.machinery, importlib.util, sys

class _SanitizedEngine:
    def find_spec(self, name, path=None, target=None):
        if name == "adapter.backends.local._engine":
            import os
            if os.environ.get("SANITIZED_MARKS"):  # which processes loaded this build
                open(os.path.join(os.environ["SANITIZED_MARKS"], str(os.getpid())), "w").close()
            loader = importlib.machinery.ExtensionFileLoader(name, {path!r})
            return importlib.util.spec_from_file_location(name, {path!r}, loader=loader)
        return None

sys.meta_path.insert(0, _SanitizedEngine())
'''


def _runtime(name: str) -> str | None:
    path = subprocess.run(["cc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.fixture(scope="module")
def sanitized(tmp_path_factory) -> dict[str, str]:
    """The environment that loads the sanitizer build: sitecustomize's finder, the runtimes."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    asan, ubsan = _runtime("libasan.so"), _runtime("libubsan.so")
    if asan is None or ubsan is None:
        pytest.skip("the compiler has no ASan/UBSan runtime")
    folder = tmp_path_factory.mktemp("asan")
    module = folder / ("_engine" + sysconfig.get_config_var("EXT_SUFFIX"))
    sources = [str(p) for folder in ("shm", "python") for p in sorted(Path(ROOT, "csrc", folder).glob("*.c"))]
    subprocess.run(["cc", "-std=c11", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                    "-DJL_STORES_FORCE=1",
                    "-fno-sanitize-recover=all", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
                    "-I", sysconfig.get_paths()["include"], "-I", numpy.get_include(), *sources, "-o", str(module)],
                   check=True)
    (folder / "sitecustomize.py").write_text(LOADER.format(path=str(module)))
    env = dict(os.environ)
    env.update(PYTHONPATH=f"{folder}{os.pathsep}{ROOT}", LD_PRELOAD=f"{asan} {ubsan}",
               ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86",
               UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=87")
    return env


@pytest.mark.timeout(150)
def test_results_under_asan_and_ubsan(sanitized):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           "tests/native/test_results.py", "tests/native/test_max_min.py"], cwd=ROOT, env=sanitized,
                          capture_output=True,
                          text=True, timeout=140)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "Sanitizer" not in output and "runtime error" not in output, output[-6000:]
    # The finder really loaded the sanitizer build (a build without ASan would load silently).
    probe = subprocess.run([sys.executable, "-c", "import adapter.backends.local._engine as e; print(e.__file__)"],
                           cwd=ROOT, env=sanitized, capture_output=True, text=True, timeout=60)
    assert sanitized["PYTHONPATH"].split(os.pathsep)[0] in probe.stdout, probe.stdout + probe.stderr


@pytest.mark.timeout(150)
def test_random_stress_and_a_kill_under_asan_and_ubsan(sanitized):
    script = os.path.join(ROOT, "tests", "native", "scripts", "stress.py")
    extra = {k: sanitized[k] for k in ("PYTHONPATH", "LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")}
    # Started directly (not by the launcher, which stops the survivors when a rank dies) and as
    # fresh interpreters (the ASan runtime must be loaded first, not forked into).
    results = run(3, script, timeout=140, fresh=True,
                  env={**extra, "STRESS_KILL": "1", "STRESS_ROUNDS": "25", "STRESS_SEED": str(os.getpid())})
    output = "\n".join(f"--- rank {r.rank} exited {r.returncode}\n{r.stdout}\n{r.stderr}" for r in results)
    assert [r.returncode for r in results] == [0, 0, -9], output[-6000:]
    assert output.count("stress ok") == 3, output[-6000:]
    assert output.count("saw the kill") == 2, output[-6000:]
    assert "Sanitizer" not in output and "runtime error" not in output, output[-6000:]


# (variant, ranks, checks): the ring's whole contract, and JACCL's data path over its local
# shared-memory path (jaccl/local.py) plus the check that the collectives did use it.
CONTRACT_LAUNCHES = [("ring", 3, None),
                     ("jaccl", 2, ("init_returns_the_launched_backend",) + DATA_PATH)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("variant_id, ranks, checks", CONTRACT_LAUNCHES, ids=[v for v, _, _ in CONTRACT_LAUNCHES])
def test_contract_on_shared_memory_under_asan_and_ubsan(sanitized, tmp_path, variant_id, ranks, checks):
    """Contract checks (checks.py) in a launch whose collectives all run over shared memory:
    each of them goes through the sanitized engine."""
    variant = next(v for v in VARIANTS if v.id == variant_id)
    names = list(checks or variant.checks_at(ranks))
    marks = tmp_path / "marks"
    marks.mkdir()
    extra = {k: sanitized[k] for k in ("PYTHONPATH", "LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")}
    worker = os.path.join(ROOT, "tests", "contract", "worker.py")
    result = launch(["-n", str(ranks), "--backend", variant.backend, sys.executable, worker, str(tmp_path),
                     variant.expected_backend, str(ranks), ",".join(names)],
                    timeout=140, env={**variant.env, **extra, "SANITIZED_MARKS": str(marks)})
    output = output_tail(result)
    assert result.returncode == 0, output
    assert "Sanitizer" not in output and "runtime error" not in output, output
    for r in range(ranks):
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        bad = {name: text for name, text in report.items() if name in names and text != "ok"}
        assert not bad and all(name in report for name in names), (r, bad, output)
    assert len(list(marks.iterdir())) >= ranks, "the ranks did not load the sanitizer build"
