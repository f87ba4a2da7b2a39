"""The torch process group's C++ c10d Backend (csrc/torch/): its private build cache, the
fallbacks to the Python group, and the Backend itself in real rank processes."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch_harness as harness

torch = pytest.importorskip("torch")

from adapter.torch_backend import native  # noqa: E402

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None


def fake_build(root, mode_dir=0o700, mode_file=0o700):
    """The cache layout of a build for this torch and these sources, holding a file that is not
    a library: the checks must refuse it before anything tries to load it."""
    key = native.build_key()
    directory = native.build_dir(key, root)
    directory.mkdir(parents=True)
    for path in (root.parent, root, directory):
        path.chmod(0o700)
    library = directory / f"{native.module_name(key)}.so"
    library.write_bytes(b"not a library")
    library.chmod(mode_file)
    directory.chmod(mode_dir)
    return directory, library


def test_a_cache_others_can_write_is_refused_before_loading(tmp_path):
    root = tmp_path / "jacklring" / "torch"
    directory, library = fake_build(root, mode_dir=0o777)
    module, why = native.load(root)
    assert module is None
    assert str(directory) in why and "0777" in why and "others may write" in why, why
    directory.chmod(0o700)
    library.chmod(0o666)
    module, why = native.load(root)
    assert module is None and "0666" in why, why


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_cache_file_of_another_user_is_refused(tmp_path):
    root = tmp_path / "jacklring" / "torch"
    _, library = fake_build(root)
    os.chown(library, 65534, 65534)
    module, why = native.load(root)
    assert module is None and "belongs to uid 65534" in why, why


def test_a_symlinked_cache_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "jacklring").mkdir(mode=0o700)
    root = tmp_path / "jacklring" / "torch"
    root.symlink_to(elsewhere)
    fake_build(elsewhere / "x")  # something to find behind the link
    with pytest.raises(native.UnsafeCache, match="symbolic link"):
        native.check_private(root)


def test_a_torch_upgrade_finds_no_build_and_says_so(tmp_path):
    root = tmp_path / "jacklring" / "torch"
    (root / "2.12.0-0123456789abcdef").mkdir(parents=True)
    (root / "2.12.0-0123456789abcdef" / "jacklring_torch_0123456789abcdef.so").write_bytes(b"old")
    (root / "2.12.0-objects").mkdir()  # the older torch's objects: not a build
    module, why = native.load(root)
    assert module is None
    assert "built for another torch (2.12.0-0123456789abcdef)" in why and torch.__version__ in why, why
    assert "python -m adapter.torch_backend.native" in why


def test_the_key_follows_the_sources_and_torch(tmp_path, monkeypatch):
    sources = tmp_path / "src"
    shutil.copytree(native.SOURCE_DIR, sources)
    key = native.build_key(sources)
    assert key == native.build_key(native.SOURCE_DIR)
    (sources / "floor.h").write_text((sources / "floor.h").read_text() + "\n// edited\n")
    assert native.build_key(sources) != key
    monkeypatch.setattr(torch, "__version__", "9.9.9")  # an upgraded torch
    assert native.build_key() != key
    assert native.build_dir(key, tmp_path).name.startswith("9.9.9-")


@pytest.mark.timeout(300)
def test_a_failed_build_fails_loudly_and_jobs_fall_back(tmp_path):
    """No working compiler: the build command fails naming why; a job asked for the C++ Backend
    (JACKLRING_TORCH_NATIVE=1) runs on the Python group with one warning line."""
    env = harness.clean_env(XDG_CACHE_HOME=str(tmp_path), CXX="/bin/false")
    done = subprocess.run([sys.executable, "-m", "adapter.torch_backend.native"], cwd=harness.ROOT, env=env,
                          capture_output=True, text=True, timeout=200)
    assert done.returncode == 1 and "did not build" in done.stderr, done
    results = harness.run(1, "cpp_fallback.py", timeout=90,
                          env=harness.clean_env(XDG_CACHE_HOME=str(tmp_path), JACKLRING_TORCH_NATIVE="1"))
    harness.assert_all_ok(results)
    warnings = [line for line in results[0].stderr.splitlines() if "runs in Python" in line]
    assert len(warnings) == 1 and "no C++ torch backend is built" in warnings[0], results[0].stderr
    # The default (auto) on ranks that share memory: the same fallback, the same one line each.
    results = harness.run(2, "cpp_fallback.py", timeout=90, env=_default_env(XDG_CACHE_HOME=str(tmp_path)))
    harness.assert_all_ok(results)
    for r in results:
        warnings = [line for line in r.stderr.splitlines() if "runs in Python" in line]
        assert len(warnings) == 1 and "no C++ torch backend is built" in warnings[0], r.stderr


@pytest.fixture(scope="module")
def built() -> None:
    """The real build in the user's cache (scripts/setup.sh makes it; built here when missing)."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler: the C++ Backend cannot be built here")
    native.build()
    module, why = native.load()
    assert module is not None, why


@pytest.mark.timeout(240)
def test_native_all_reduce_on_shared_memory_matches_gloo(built):
    """Same-host ranks: synchronous all-reduces run in C++ on the engine (no Python call), in
    order with the operations handed to the Python group; a mismatch raises the Python path's error."""
    harness.assert_all_ok(harness.run(2, "cpp_backend.py", timeout=200,
                                      env=harness.clean_env(JACKLRING_TORCH_NATIVE="1")))


@pytest.mark.timeout(240)
def test_without_shared_memory_everything_is_delegated(built):
    harness.assert_all_ok(harness.run(2, "cpp_backend.py", "no-shm", timeout=200,
                                      env=harness.clean_env(JACKLRING_TORCH_NATIVE="1",
                                                            JACKLRING_LOCAL_TRANSPORT="tcp")))


def _default_env(**extra: str) -> dict[str, str]:
    env = harness.clean_env()
    env.pop("JACKLRING_TORCH_NATIVE", None)  # the default, whatever the suite runs with
    env.update(extra)
    return env


@pytest.mark.timeout(240)
def test_the_default_is_the_cpp_backend_where_memory_is_shared(built):
    harness.assert_all_ok(harness.run(2, "cpp_backend.py", timeout=200, env=_default_env()))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("env", [{"JACKLRING_LOCAL_TRANSPORT": "tcp"}, {"JACKLRING_TORCH_NATIVE": "0"}],
                         ids=["default-without-shared-memory", "native-0"])
def test_the_python_group_without_shared_memory_or_when_asked(built, env):
    results = harness.run(2, "cpp_fallback.py", timeout=90, env=_default_env(**env))
    harness.assert_all_ok(results)
    assert all("runs in Python" not in r.stderr for r in results)


@pytest.mark.timeout(120)
def test_native_ops_route_and_number_alike_whatever_async_op(built):
    """The default (the C++ Backend): ranks pass different async_op for the same all-reduces,
    every native op matches gloo bit for bit, async native Works time out, fail and complete."""
    harness.assert_all_ok(harness.run(2, "cpp_native_ops.py", timeout=90, env=_default_env()))


@pytest.mark.timeout(120)
def test_native_headers_are_the_python_paths(built):
    """Rank 0 native, rank 1 the Python group, on one segment: the same headers or a mismatch."""
    harness.assert_all_ok(harness.run(2, "cpp_native_ops.py", "mixed-routes", timeout=90, env=_default_env()))
