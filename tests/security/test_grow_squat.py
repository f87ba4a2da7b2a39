"""Rendezvous addresses for grow, squatted between grows (issue #44 item 7). Nothing listened
at MLX_JACCL_COORDINATOR between grows, so the outsider (uid 65534, standard library only) took
it after init: the members' grow() failed, and a knocking newcomer on another host handed the
squatter a proof of the job key with every knock. Now the job's first rank 0 keeps the side
channel's listener bound there from init on, answering knocks "no grow in progress" at their
HELLO (no proof crosses), and a grow's Door serves on that same listener: the outsider cannot
bind the address, and the newcomer is taken in."""
from __future__ import annotations

import signal
import subprocess
import time

import pytest
from faults.cluster import ATTACK, SECRETS, finish_all, grow_back, rank_envs, reports, start, stop_all


@pytest.mark.timeout(90)
def test_the_coordinator_is_held_between_grows_and_the_newcomer_is_taken_in(tmp_path):
    go = tmp_path / "go"
    env = {"FAULT_GO": str(go), **SECRETS["passphrase"]}
    procs = []
    try:
        envs = rank_envs("jaccl", 3, tmp_path)
        procs = start("jaccl", 3, grow_back(grow_timeout=10), tmp_path, env=env, envs=envs)
        for p in procs:
            p.wait_line("READY", 40)
        procs[2].kill(signal.SIGKILL)
        for i in (0, 1):
            procs[i].wait_line("SHRUNK", 20)
        host, port = envs[0]["MLX_JACCL_COORDINATOR"].rsplit(":", 1)
        squatter = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                   "/usr/bin/python3", "-c", ATTACK, host, port, "3"],
                                  capture_output=True, text=True, cwd="/", timeout=20)
        assert "LISTENING" not in squatter.stdout and "Address already in use" in squatter.stderr, \
            squatter.stdout + squatter.stderr
        procs += start("jaccl", 3, grow_back(), tmp_path, envs=envs, ranks=[2],
                       env={**env, "JACKLRING_JOIN": "1", "JACKLRING_CONNECT_TIMEOUT": "20"})
        time.sleep(1.0)  # the newcomer knocks while no grow is in progress: told so, and knocks again
        go.write_text("")
        for i in (0, 1, 3):
            fields = procs[i].wait_line("SUM", 20)
            assert fields[3:5] == ["3", "0,1,2"] and fields[5] == fields[6] == "6.0", fields
        codes = finish_all(procs, 15)
    finally:
        stop_all(procs)
    assert [codes[i] for i in (0, 1, 3)] == [0, 0, 0], reports(procs)
