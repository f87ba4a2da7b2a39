"""JACCL jobs that go wrong, started by the real launcher: a forced RDMA transport with no device
named, and faults (mismatched dtype or op, a dead rank, a wrong-size recv, an uncaught exception)
that must end the job with one clear error and a non-zero exit naming a rank. The public API on
JACCL (TCP mesh, ring mode, a group of one) is in the backend contract (tests/contract)."""
from __future__ import annotations

import pytest
from ranks import ROOT, launch, output_tail

SCRIPTS = f"{ROOT}/tests/jaccl_scripts"


@pytest.mark.timeout(60)
def test_rdma_forced_with_a_matrix_of_nulls_says_no_device_is_named():
    r = launch(["--backend", "jaccl", "-n", "2", f"{SCRIPTS}/exchange.py"], timeout=50,
               env={"JACKLRING_JACCL_TRANSPORT": "rdma"})
    assert r.returncode != 0, output_tail(r)
    assert "names no RDMA device" in r.stdout + r.stderr, output_tail(r)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault, words", [
    ("dtype", "MismatchError"),
    ("op", "MismatchError"),
    ("dead", "rank 1 (host 127.0.0.1) exited with code 3"),  # the others may be stopped before they report
    ("p2p", "MismatchError"),
    ("raise", "boom on purpose"),
])
def test_faults_end_the_job_with_one_clear_error(fault, words):
    r = launch(["--backend", "jaccl", "-n", "3", f"{SCRIPTS}/faults.py"], timeout=50, env={"FAULT": fault})
    out = r.stdout + r.stderr
    assert r.returncode != 0, output_tail(r)
    assert words in out, output_tail(r)
    assert "launcher: rank " in r.stderr, output_tail(r)  # the launcher names a failing rank
