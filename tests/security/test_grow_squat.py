"""Rendezvous addresses for grow, squatted between grows (issue #44 item 7). Nothing listens at
MLX_JACCL_COORDINATOR between grows, so the outsider (uid 65534, standard library only) takes
it after init. Before, the members' grow() failed saying only "Address already in use", and a
knocking newcomer handed the squatter a proof of the job key with every knock. Now grow() names
the squatter (its uid, and its pid where /proc shows it), and a newcomer on this host checks
who listens there and sends no knock to another user's listener, saying so."""
from __future__ import annotations

import signal
import subprocess

import pytest
from faults.cluster import ATTACK, SECRETS, finish_all, grow_back, rank_envs, reports, start, stop_all


@pytest.mark.timeout(90)
def test_a_squatted_coordinator_is_named_and_gets_no_knock(tmp_path):
    go = tmp_path / "go"
    env = {"FAULT_GO": str(go), **SECRETS["passphrase"]}
    squatter = None
    procs = []
    try:
        envs = rank_envs("jaccl", 3, tmp_path)
        procs = start("jaccl", 3, grow_back(grow_timeout=3), tmp_path, env=env, envs=envs)
        for p in procs:
            p.wait_line("READY", 40)
        procs[2].kill(signal.SIGKILL)
        for i in (0, 1):
            procs[i].wait_line("SHRUNK", 20)
        host, port = envs[0]["MLX_JACCL_COORDINATOR"].rsplit(":", 1)
        squatter = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                     "/usr/bin/python3", "-c", ATTACK, host, port, "12"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        assert squatter.stdout.readline().split() == ["LISTENING"], squatter.stderr.read()
        procs += start("jaccl", 3, grow_back(), tmp_path, envs=envs, ranks=[2],
                       env={**env, "JACKLRING_JOIN": "1", "JACKLRING_CONNECT_TIMEOUT": "4"})
        go.write_text("")
        for i in (0, 1):
            text = " ".join(procs[i].wait_line("GROWERR", 20)[3:])
            assert f"MLX_JACCL_COORDINATOR={host}:{port}" in text and "held by uid 65534" in text, text
            assert f"pid {squatter.pid}" in text or "pid not visible" in text, text
        initerr = " ".join(procs[3].wait_line("INITERR", 20))
        finish_all(procs, 15)
    finally:
        stop_all(procs)
        if squatter is not None:
            squatter.kill()
    seen = squatter.communicate()[0] if squatter is not None else ""
    assert "held by uid 65534" in initerr and "no knock was sent" in initerr, initerr
    assert "did not prove the job secret" not in initerr, initerr  # it never reached the handshake
    assert not procs[3].tagged("GROWN"), reports(procs)
    assert seen.split()[:1] != ["SEEN"] or seen.split()[1] == "0", seen  # no knock, so no proof
