"""A send to a member that has left the group (its process exited normally, its listener is
closed) fails within about a second naming it, instead of retrying the connection until the
operation's deadline (JACKLRING_TIMEOUT, 300 s by default)."""
from __future__ import annotations

import pytest
from cluster import finish_all, reports, start, stop_all

# Rank 0 leaves right after forming; the others send to it once the test saw it exit.
BODY = """
say("FORMED")
if r != 0:
    go = os.path.join(os.environ["FAULT_DIR"], "go")
    until = time.monotonic() + 20
    while not os.path.exists(go) and time.monotonic() < until:
        time.sleep(0.02)
    t = time.monotonic()
    try:
        send(np.arange(10.0), 0)
        say("SENT")
    except Exception as e:
        say("ERROR", f"{time.monotonic() - t:.2f}", getattr(e, "culprit", None), one_line(e))
"""


@pytest.mark.timeout(40)
@pytest.mark.parametrize("n", [2, 3])
def test_a_send_to_a_rank_that_exited_fails_within_a_second_naming_it(tmp_path, n):
    procs = start("ring", n, BODY, tmp_path, env={"FAULT_DIR": str(tmp_path), "JACKLRING_TIMEOUT": "30"})
    try:
        assert procs[0].finish(20) == 0, reports(procs)
        (tmp_path / "go").touch()
        codes = finish_all(procs[1:], 20)
    finally:
        stop_all(procs)
    for p in procs[1:]:
        found = p.tagged("ERROR")
        assert found, reports(procs)
        _, _, seconds, culprit, *message = found[0]  # rank, time said, then ours
        assert float(seconds) < 2.5 and culprit == "0", reports(procs)
        assert "rank 0 has left" in " ".join(message), reports(procs)
    assert all(c != -9 for c in codes), reports(procs)
