"""The engine's fast path (one C call from ops: csrc/python/shell.c) beside the Python path, in
real jobs over shared memory: bit-identical results and one sequence number when ranks mix the
paths, a mismatch and a dead peer worded as the Python path words them, the GIL released while
the fast path waits (tests/shm/scripts/shell_paths.py says what each job checks)."""
from __future__ import annotations

import pytest
from ranks import assert_all_ok, jaccl_env, run


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
def test_fast_and_python_paths_mix_agree_and_fail_alike(backend, tmp_path):
    env = jaccl_env(2, str(tmp_path)) if backend == "jaccl" else {}
    assert_all_ok(run(2, "shm/scripts/shell_paths.py", ["mix"], timeout=50, env=env))


@pytest.mark.timeout(60)
def test_a_dead_peer_is_named_alike_on_the_fast_and_the_python_path():
    results = run(3, "shm/scripts/shell_paths.py", ["dead"], timeout=50)
    assert_all_ok(results)
    assert all("ok" in r.stdout for r in results[:2])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
def test_plain_tensors_take_the_fast_path_and_agree_with_the_python_path(backend, tmp_path):
    env = jaccl_env(2, str(tmp_path)) if backend == "jaccl" else {}
    assert_all_ok(run(2, "shm/scripts/tensor_paths.py", timeout=80, env=env))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend,ranks", [("ring", 2), ("ring", 3), ("jaccl", 2)])
def test_gather_scatter_broadcast_barrier_take_the_fast_path_and_agree(backend, ranks, tmp_path):
    env = jaccl_env(ranks, str(tmp_path)) if backend == "jaccl" else {}
    assert_all_ok(run(ranks, "shm/scripts/op_paths.py", timeout=80, env=env))
