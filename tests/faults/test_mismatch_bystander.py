"""A mismatched collective seen by a rank that did not disagree (a bystander): rank 1 calls
all_max where ranks 0 and 2 (and 3) call all_sum. Every rank must learn that it was a mismatch
between two named ranks (a MismatchError), not only that a peer left (a PeerError)."""
from __future__ import annotations

import re

import pytest
from cluster import finish_all, reports, start, stop_all

BODY = """
barrier()
try:
    (all_max if r == 1 else all_sum)(np.ones(1000, np.float32))
except ERRORS as e:
    say("ERR", one_line(e))
    sys.exit(3)
say("NOERR")
"""

# Each rank files the standby connections it makes (ring/standby.py) 0.4 s late, as a starved
# opener thread does: the failing rank may have written its word on one that the bystander has
# not filed yet when it looks, and must still read it.
LATE_STANDBY = """
import threading

import adapter.backends.ring.standby as standby

class LateLink(standby._Link):
    def __init__(self, *args):
        if threading.current_thread().name.startswith("jacklring-standby"):  # the opener's side
            time.sleep(0.4)
        super().__init__(*args)

standby._Link = LateLink
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend, n, env", [
    ("ring", 3, {"JACKLRING_LOCAL_TRANSPORT": "tcp"}), ("ring", 4, {"JACKLRING_LOCAL_TRANSPORT": "tcp"}),
    ("ring", 4, {"JACKLRING_LOCAL_TRANSPORT": "tcp", "FAULT_BEFORE_INIT": LATE_STANDBY}),
    ("ring", 3, {}), ("jaccl", 3, {}), ("jaccl", 4, {})],
    ids=["tcp-3", "tcp-4", "tcp-4-late-standby", "shm-3", "jaccl-3", "jaccl-4"])
def test_every_rank_learns_of_the_mismatch_between_the_two(tmp_path, backend, n, env):
    procs = start(backend, n, BODY, tmp_path, env=env)
    try:
        errors = {p.rank: " ".join(p.wait_line("ERR", 30)[2:]) for p in procs}
        codes = finish_all(procs, 20)
    finally:
        stop_all(procs)
    print(errors)
    assert codes == [3] * n, reports(procs)
    for rank, text in errors.items():
        assert text.startswith("MismatchError") and "mismatch" in text, (rank, text)
        # the ranks that disagreed name both requests; a bystander names the two ranks
        pair = re.search(r"\branks (\d+) and (\d+) called different collectives", text)
        if pair:
            assert "1" in pair.groups(), (rank, text)
        else:
            assert re.search(r"\brank 1\b", text) and "max" in text and "sum" in text, (rank, text)
