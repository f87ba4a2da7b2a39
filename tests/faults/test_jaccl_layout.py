"""JACCL ranks whose device files differ (another world size) all get a ConfigError naming both
views within seconds, as the ring's ranks do (transport/layout.py), not a PeerError at the
connect deadline: the rank refused by rank 0's side channel as another job asks rank 0 for its
layout, and rank 0, told by its acceptor, passes the mismatch on to the ranks of its own view."""
from __future__ import annotations

import json
import re
import secrets

import pytest
from cluster import finish_all, mesh_matrix, rank_envs, start

CONNECT_S = 30
BODY = """
say("FORMED")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("odd", [0, 2])
def test_ranks_of_different_device_files_all_raise_a_config_error(tmp_path, odd):
    envs = rank_envs("jaccl", 4, tmp_path)
    three = tmp_path / "jaccl-devices-3.json"
    three.write_text(json.dumps(mesh_matrix(3)))
    envs[odd]["MLX_IBV_DEVICES"] = str(three)  # this rank believes the world has 3 ranks
    env = {"JACKLRING_SECRET": "drawn256:" + secrets.token_hex(32), "JACKLRING_CONNECT_TIMEOUT": str(CONNECT_S)}
    procs = start("jaccl", 4, BODY, tmp_path, env=env, envs=envs)
    finish_all(procs, 20)
    for p in procs:
        began = [float(fields[1]) for fields in p.tagged("INIT")]
        errors = p.tagged("INITERR")
        assert errors and began, p.report()
        when, text = float(errors[0][1]), " ".join(errors[0][2:])
        assert text.startswith("LayoutMismatch") and "disagree on the group's layout" in text, p.report()
        assert re.search(r"believes the world has [34] ranks, rank \d believes [34]\b", text), text
        assert when - began[0] < 8.0, f"rank {p.rank} raised {when - began[0]:.1f} s into init(): {text}"
        print(p.rank, round(when - began[0], 2), text)
