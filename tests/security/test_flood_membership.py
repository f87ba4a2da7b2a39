"""A connection flood from 127.0.0.1 must not decide who survives a shrink (issue #44 item 4).
The per-source handshake budget was keyed by IP, which the job shares with every local user:
the outsider (uid 65534) churning about 300 connections a second at each rank's port spent
the budget that shrink's own connections needed, and the survivors failed with a QuorumError
("only old ranks [...] answered") or cut a live rank out. Now shrink reaches a peer on this
host over its Unix socket, where the acceptor counts this user's handshakes by SO_PEERCRED
apart from the flood, and retries a closed connection until its window ends."""
from __future__ import annotations

import json
import signal
import time

import pytest
from faults.cluster import finish_all, reports, start, stop_all
from security_helpers import outsider_fixture, wait_ready  # noqa: F401  (the `outsider` fixture)

BODY = """
x = np.full(64, float(r + 1), np.float32)
all_sum(x)
say("READY")
import pathlib
go = pathlib.Path(os.environ["FAULT_DIR"]) / "go"
while not go.exists():
    time.sleep(0.01)
if r == 1:
    time.sleep(60)
try:
    all_sum(x)
except ERRORS as e:
    say("ERR", type(e).__name__)
try:
    new = group.shrink(timeout=3.0)
except ERRORS as e:
    say("SHRINKERR", type(e).__name__, str(e).replace("\\n", " ")[:300])
    sys.exit(5)
members = all_gather(np.array([r], np.int64), group=new)
say("SHRUNK", ",".join(str(int(m)) for m in members))
"""


@pytest.mark.timeout(120)
def test_a_flood_from_127_0_0_1_does_not_decide_who_survives_a_shrink(tmp_path, outsider):
    procs = start("ring", 3, BODY, tmp_path, env={"FAULT_DIR": str(tmp_path), "JACKLRING_LOCAL_TRANSPORT": "tcp"})
    try:
        for p in procs:
            p.wait_line("READY", 40)
        addresses = [a[0] for a in json.loads((tmp_path / "ring-hosts.json").read_text())]
        flood = outsider("churn.py", 40, 300 * len(addresses), *addresses)  # ~300 a second at each
        wait_ready(flood)
        time.sleep(3.0)  # the flood has spent the shared budget before the fault
        procs[1].kill(signal.SIGKILL)
        (tmp_path / "go").touch()
        codes = finish_all([procs[0], procs[2]], 60)
    finally:
        stop_all(procs)
    flood.kill()
    said = flood.communicate()[0]
    assert codes == [0, 0], reports(procs) + said
    for p in (procs[0], procs[2]):
        assert p.tagged("SHRUNK")[0][2:] == ["0,2"], reports(procs)
