"""JACCL over the TCP mesh transport: real rank processes on 127.0.0.1 with the MLX environment
contract (MLX_RANK, MLX_JACCL_COORDINATOR, MLX_IBV_DEVICES with fake device names). The ranks
share a host, so JACKLRING_LOCAL_TRANSPORT=tcp keeps their collectives on the mesh; the tests at
the end let them run over shared memory (the default on one host)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zygote

from adapter.bench import free_ports

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "jaccl_scripts" / "worker.py"


def free_port() -> int:
    return free_ports(1)[0]  # below the ephemeral range: no client can take it meanwhile


def mesh_matrix(n: int) -> list:
    return [[None if i == j else f"rdma_en{j + 2}" for j in range(n)] for i in range(n)]


def ring_matrix(n: int) -> list:
    return [[f"rdma_en{j + 2}" if j in ((i - 1) % n, (i + 1) % n) and j != i else None for j in range(n)]
            for i in range(n)]


def run_ranks(tmp_path: Path, matrix: list, scenarios: str, extra_env: dict | None = None,
              timeout: float = 60.0, expect_ok: bool = True) -> list[dict]:
    """Spawn one worker per rank, wait for all (killing them at the timeout), return reports."""
    devices = tmp_path / "devices.json"
    devices.write_text(json.dumps(matrix))
    port = free_port()
    procs = []
    for rank in range(len(matrix)):
        env = dict(os.environ, MLX_RANK=str(rank), MLX_JACCL_COORDINATOR=f"127.0.0.1:{port}",
                   MLX_IBV_DEVICES=str(devices), PYTHONPATH=str(REPO), JACKLRING_TIMEOUT="30",
                   JACKLRING_CONNECT_TIMEOUT="30", JACKLRING_LOCAL_TRANSPORT="tcp")
        env.pop("JACKLRING_JACCL_TRANSPORT", None)
        env.update(extra_env or {})
        procs.append(zygote.popen([sys.executable, str(WORKER), scenarios, str(tmp_path)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if expect_ok:
        for rank, (code, out, err) in enumerate(outputs):
            assert code == 0, f"rank {rank} exited {code}\n{out}\n{err}"
    reports = []
    for rank in range(len(matrix)):
        path = tmp_path / f"rank{rank}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {"stderr": outputs[rank][2]})
    return reports


def assert_identical_reductions(reports: list[dict]) -> None:
    first = reports[0]["digests"]
    assert first, "no reductions recorded"
    for report in reports[1:]:
        assert report["digests"] == first, f"rank {report['rank']} differs from rank 0 bit for bit"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_mesh_all_ops(tmp_path, n):
    scenarios = "ops,p2p,split" + (",api" if n == 2 else "")
    reports = run_ranks(tmp_path, mesh_matrix(n), scenarios, timeout=100)
    assert all(r["mode"] == "mesh" and r["transport"] == "tcp" and r["ops"] == "ok" for r in reports)
    assert all(r["p2p"] == "ok" for r in reports)
    assert_identical_reductions(reports)
    if n == 2:
        assert all(r["api"] == "jaccl" for r in reports)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_every_op_is_right_with_checksums(tmp_path, n):
    """JACKLRING_VERIFY=1: every frame carries a CRC-32 checked on receipt; all results stay right
    and bit-identical (one-frame, reduce-scatter/all-gather and multi-frame paths, p2p, split)."""
    reports = run_ranks(tmp_path, mesh_matrix(n), "ops,p2p,split", {"JACKLRING_VERIFY": "1"}, timeout=100)
    assert all(r["ops"] == "ok" and r["p2p"] == "ok" for r in reports)
    assert_identical_reductions(reports)


@pytest.mark.timeout(120)
def test_ring_mode_runs_ring_algorithms(tmp_path):
    """MLX_JACCL_RING=1 with a ring-only matrix (what `--backend jaccl-ring` produces); the split
    leaves rank 1 alone in its group, which must come back as a group of one."""
    reports = run_ranks(tmp_path, ring_matrix(3), "ops,p2p,split", {"MLX_JACCL_RING": "1"}, timeout=100)
    assert all(r["mode"] == "ring" and r["ops"] == "ok" for r in reports)
    assert_identical_reductions(reports)


@pytest.mark.timeout(60)
def test_full_matrix_with_ring_preference_is_a_ring(tmp_path):
    # Ring algorithms, yet 0 <-> 2 (not neighbours) exchange too: the TCP transport links every
    # pair (only RDMA ring mode is limited to its cables).
    reports = run_ranks(tmp_path, mesh_matrix(4), "p2p", {"MLX_JACCL_RING": "1"}, timeout=45)
    assert all(r["mode"] == "ring" and r["transport"] == "tcp" and r["p2p"] == "ok" for r in reports)


@pytest.mark.timeout(60)
def test_collective_mismatch_raises_on_both_sides(tmp_path):
    reports = run_ranks(tmp_path, mesh_matrix(3), "mismatch", timeout=45)
    for rank in (0, 1):
        error = reports[rank]["error"]
        assert error and error.startswith("MismatchError"), error
        assert "all_reduce(sum) of 16 bytes (float32)" in error and "all_gather of 16 bytes (float32)" in error
    # rank 0 sees rank 1's request; rank 1 may report either of the two ranks that disagree with it
    assert "rank 0: mismatched operations with rank 1" in reports[0]["error"]
    assert "rank 1: mismatched operations with rank" in reports[1]["error"]


@pytest.mark.timeout(60)
def test_send_recv_size_mismatch_names_both_requests(tmp_path):
    reports = run_ranks(tmp_path, mesh_matrix(2), "recv_mismatch", timeout=45)
    error = reports[1]["error"]
    assert error and "recv of 32 bytes (float32) from rank 0" in error and "send of 16 bytes (float32)" in error


@pytest.mark.timeout(60)
def test_dead_peer_is_named_within_seconds(tmp_path):
    reports = run_ranks(tmp_path, mesh_matrix(3), "dead_peer", timeout=45, expect_ok=False)
    for rank in (0, 2):
        error = reports[rank]["error"]
        assert error and error.startswith("PeerError") and "rank 1" in error, error
        assert reports[rank]["seconds"] < 20  # JACKLRING_TIMEOUT is 30: EOF, not the deadline


@pytest.mark.timeout(60)
def test_forced_rdma_without_a_device_fails_clearly(tmp_path):
    reports = run_ranks(tmp_path, mesh_matrix(2), "ops", {"JACKLRING_JACCL_TRANSPORT": "rdma"}, timeout=45,
                        expect_ok=False)
    for r in reports:
        assert "BackendUnavailable" in r["stderr"] and "cannot use RDMA" in r["stderr"], r["stderr"][-2000:]


@pytest.mark.timeout(90)
def test_a_second_thread_gets_a_clear_error_and_the_group_goes_on(tmp_path):
    """The deterministic form of the contract's JACCL thread limitation (there, whether the two
    threads' calls overlap is up to the scheduler)."""
    reports = run_ranks(tmp_path, mesh_matrix(2), "second_thread", timeout=60)
    assert all(r["second_thread"] == "ok" for r in reports)


# ---- ranks on one host over shared memory (JACKLRING_LOCAL_TRANSPORT=auto, the default) -----------

SHM = {"JACKLRING_LOCAL_TRANSPORT": "auto"}


@pytest.mark.timeout(120)
def test_ranks_on_one_host_run_collectives_over_shared_memory(tmp_path):
    """Every collective, p2p over the mesh beside them, and split sub-groups with memory of their own."""
    reports = run_ranks(tmp_path, mesh_matrix(4), "ops,p2p,split", SHM, timeout=100)
    assert all(r["shared_memory"] and r["split_shared_memory"] for r in reports), reports
    assert all(r["ops"] == "ok" and r["p2p"] == "ok" for r in reports)
    assert_identical_reductions(reports)


@pytest.mark.timeout(60)
def test_told_tcp_the_collectives_stay_on_the_mesh(tmp_path):
    reports = run_ranks(tmp_path, mesh_matrix(2), "p2p", timeout=45)
    assert not any(r["shared_memory"] for r in reports)


@pytest.mark.timeout(60)
def test_collective_mismatch_over_shared_memory_is_worded_as_on_the_mesh(tmp_path):
    reports = run_ranks(tmp_path, mesh_matrix(3), "mismatch", SHM, timeout=45)
    for rank in (0, 1):
        error = reports[rank]["error"]
        assert error and error.startswith("MismatchError") and "[shared memory]" in error, error
        assert "all_reduce(sum) of 16 bytes (float32)" in error and "all_gather of 16 bytes (float32)" in error
    assert "rank 0: mismatched operations with rank 1" in reports[0]["error"]
    assert "rank 1: mismatched operations with rank" in reports[1]["error"]


@pytest.mark.timeout(60)
def test_dead_peer_over_shared_memory_is_named_within_seconds(tmp_path):
    reports = run_ranks(tmp_path, mesh_matrix(3), "dead_peer", SHM, timeout=45, expect_ok=False)
    for rank in (0, 2):
        error = reports[rank]["error"]
        assert reports[rank]["shared_memory"]
        assert error and error.startswith("PeerError") and "rank 1" in error, error
        # its pidfd or its mesh socket, watched while waiting; not the deadline (JACKLRING_TIMEOUT is 30)
        assert reports[rank]["seconds"] < 5, error
