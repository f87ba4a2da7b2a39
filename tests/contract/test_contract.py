"""The backend contract on every backend and group size: one test per (variant, size, check),
e.g. test_contract[jaccl-3-broadcast_from_every_root]. The checks are in checks.py, the
backends in backends.py; each (variant, size) is launched once (launches.py)."""
from __future__ import annotations

import pytest

from .backends import VARIANTS, Variant
from .launches import LAUNCH_TIMEOUT_S, Launches

# Checks a backend fails today, by (Group.backend_name, check): real bugs, left for the lead to
# fix or to declare outside the contract. strict=True: a fix makes the test fail until removed.
_JACCL_NO_LOCK = (
    "a limitation, not a silent failure: JACCL matches every peer's frames strictly in order over shared "
    "links, so one group runs one operation at a time; a second thread gets a DistributedError saying so "
    "(adapter/backends/jaccl/backend.py JacclBackend._one_thread) and needs a group of its own (split)")
KNOWN_BUGS: dict[tuple[str, str], str] = {
    ("jaccl", "two_threads_sending_to_one_peer_never_interleave"): _JACCL_NO_LOCK,
    ("jaccl", "send_recv_in_a_thread_while_collectives_run"): _JACCL_NO_LOCK,
}
# The same for the collective-mismatch launch, by Group.backend_name.
KNOWN_MISMATCH_BUGS: dict[str, str] = {
    "mpi": (
        "adapter/backends/mpi/backend.py MPIBackend.all_reduce (and the other collectives) pass each "
        "rank's own dtype and count to MPI without checking that the ranks agree (the module docstring "
        "calls it undefined): rank 0 gets DistributedError MPI_ERR_TRUNCATE, not MismatchError, and the "
        "float64 ranks return wrong sums silently, or now and then a rank exits and mpirun stops the job "
        "before the others report (the launch then has no results). JACKLRING_VERIFY=1 adds the agreement check "
        "(tests/mpi/test_mpi_backend.py); by default MPI's own speed is kept"),
}

# Waiting for a launch queued behind others counts too.
TEST_TIMEOUT_S = 3 * LAUNCH_TIMEOUT_S


def _cases() -> list:
    cases = []
    for variant in VARIANTS:
        for size in variant.sizes:
            missing = variant.missing(size)
            for name in variant.checks_at(size):
                marks = [pytest.mark.skip(reason=missing)] if missing else []
                bug = KNOWN_BUGS.get((variant.expected_backend, name))
                if bug:
                    # Not strict for JACCL's thread limitation: the check passes whenever the two
                    # threads' calls happen not to overlap (tests/jaccl/test_jaccl_mesh.py forces it).
                    strict = bug is not _JACCL_NO_LOCK
                    marks.append(pytest.mark.xfail(strict=strict, raises=AssertionError, reason=bug))
                cases.append(pytest.param(variant, size, name, id=f"{variant.id}-{size}-{name}", marks=marks))
    return cases


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("variant, size, check", _cases())
def test_contract(launches: Launches, variant: Variant, size: int, check: str) -> None:
    ranks = launches.get(variant, size).rank_results()
    bad = {r: result.get(check, "not reported") for r, result in enumerate(ranks) if result.get(check) != "ok"}
    assert not bad, "\n".join(f"--- rank {r}\n{text}" for r, text in bad.items())


MISMATCH_SIZE = 3


def _mismatch_cases() -> list:
    cases = []
    for v in VARIANTS:
        if v.checks is not None or v.env or v.launcher_args or v.id.startswith("ring-"):
            continue  # one launch per backend; settings variants add nothing here
        marks = [pytest.mark.skip(reason=v.missing(MISMATCH_SIZE))] if v.missing(MISMATCH_SIZE) else []
        if v.expected_backend in KNOWN_MISMATCH_BUGS:
            # Failed: the launch without results (rank_results), one more face of the same bug
            marks.append(pytest.mark.xfail(strict=True, raises=(AssertionError, pytest.fail.Exception),
                                           reason=KNOWN_MISMATCH_BUGS[v.expected_backend]))
        cases.append(pytest.param(v, MISMATCH_SIZE, "--mismatch", id=f"{v.id}-{MISMATCH_SIZE}", marks=marks))
    return cases


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("variant, size, mode", _mismatch_cases())
def test_ranks_calling_different_collectives_get_a_MismatchError(launches: Launches, variant: Variant, size: int,
                                                                mode: str) -> None:
    """Rank 0 sums float32 while the others sum float64 (a separate launch: it breaks the group).
    No rank may return a result; the ranks that can see the other side's request raise
    MismatchError naming themselves and a peer; the others fail with a DistributedError."""
    ranks = launches.get(variant, size, mode).rank_results()
    assert not [r for r, res in enumerate(ranks) if "returned" in res], ranks
    assert all(res["distributed"] for res in ranks), ranks
    seen = [r for r, res in enumerate(ranks) if res["raised"] == "MismatchError"]
    assert seen, ranks
    for r in seen:
        message = ranks[r]["message"]
        others = [q for q in range(size) if q != r and f"rank {q}" in message]
        assert f"rank {r}" in message and others, message
