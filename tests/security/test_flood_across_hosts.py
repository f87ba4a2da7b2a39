"""A connection flood from a host's own address must not decide membership across hosts (issue
#44 item 4). The per-source handshake budget is keyed by IP, which a rank shares with every user
of its host: the outsider (uid 65534) on the second host churning about 300 connections a second
at rank 0 spent the budget the second host's ranks needed for their connections to rank 0, so a
shrink after a death cut live ranks out or failed. Now a source over its budget is still served,
on probation (the newest of a few slots, evicting the oldest): a connection that proves the job
key promptly is never refused for budget, and only connections that fail spend it. Rank 0 runs in
one network namespace, ranks 1 and 2 and the outsider in the other (two hosts). Needs root."""
from __future__ import annotations

import signal
import time

import pytest
from faults.cluster import finish_all, rank_envs, reports, start, stop_all
from security_helpers import outsider_fixture, wait_ready  # noqa: F401  (the `outsider` fixture)
from test_flood_membership import BODY
from test_open_hostfile import veth_fixture  # noqa: F401  (the `veth` fixture: two hosts)

RATE = 400  # connections a second from each outsider


@pytest.mark.timeout(120)
def test_a_flood_from_a_ranks_host_does_not_decide_who_survives_a_shrink_across_hosts(tmp_path, veth, outsider):
    hosts = [veth.addresses[0]] + [veth.addresses[1]] * 3
    envs = rank_envs("ring", 4, tmp_path, hosts=hosts)
    procs = start("ring", 4, BODY, tmp_path, envs=envs, env={"FAULT_DIR": str(tmp_path)},
                  wraps={0: veth.exec_prefix(0), **{r: veth.exec_prefix(1) for r in (1, 2, 3)}})
    floods = []
    try:
        for p in procs:
            p.wait_line("READY", 40)
        # at rank 0 from the second host's address, at ranks 1 and 2 from the first host's
        floods = [outsider("churn.py", 40, RATE, f"{veth.addresses[0]}:41000", wrap=veth.exec_prefix(1)),
                  outsider("churn.py", 40, 3 * RATE, *(f"{veth.addresses[1]}:{41000 + r}" for r in (1, 2, 3)),
                           wrap=veth.exec_prefix(0))]
        for flood in floods:
            wait_ready(flood)
        time.sleep(3.0)  # the flood has spent the second host's budget at rank 0 before the fault
        procs[1].kill(signal.SIGKILL)
        (tmp_path / "go").touch()
        codes = finish_all([procs[0], procs[2], procs[3]], 60)
    finally:
        stop_all(procs)
        for flood in floods:
            flood.kill()
    said = " ".join(flood.communicate()[0] for flood in floods)
    assert codes == [0, 0, 0], reports(procs) + said
    for p in (procs[0], procs[2], procs[3]):
        assert p.tagged("SHRUNK")[0][2:] == ["0,2,3"], reports(procs)
