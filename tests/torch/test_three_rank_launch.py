"""Every op against gloo, point-to-point, and forming the group again and again: three checks of
the jacklring torch group that each need three ranks and leave the group as they found it, so one
launch of three ranks runs all three scripts one after the other (workers/parts.py) and each
test reads its script's part. Three ranks importing torch cost seconds of CPU; one launch instead
of three saves two of them. The file is one xdist group (tests/conftest.py), so its tests see the
same launch."""
from __future__ import annotations

import dataclasses

import pytest
import torch_harness as harness

pytest.importorskip("torch")

SCRIPTS = ("ops_parity.py", "p2p.py", "lifecycle.py")  # lifecycle last: it sets env:// variables


@pytest.fixture(scope="module")
def launch() -> list[harness.Result]:
    """One port per script: a script's group forms on a port no store of an earlier one holds."""
    port, *ports = harness.free_ports(1 + len(SCRIPTS))
    specs = [f"{script}:{p}" for script, p in zip(SCRIPTS, ports)]
    return harness.collect(harness.spawn(3, "parts.py", *specs, port=port), 200)


def _part(results: list[harness.Result], script: str, marker: str) -> None:
    """Each rank ran the script to its marker: the output from "=== script" to the next part,
    and the rank exited 0, or 1 for another script's failure (never a signal or a crash at exit)."""
    def cut(text: str) -> str:
        start = text.find(f"=== {script}\n")
        if start < 0:
            return ""
        end = text.find("\n=== ", start + 1)
        return text[start:] if end < 0 else text[start:end + 1]
    parts = [dataclasses.replace(r, stdout=cut(r.stdout)) for r in results]
    bad = [p for p, r in zip(parts, results)
           if marker not in p.stdout or not (r.returncode == 0 or (r.returncode == 1 and " FAILED\n" in r.stdout))]
    assert not bad, f"{script}:\n" + "\n".join(r.report() for r in results)


# The first test to run also waits for the launch (200 s at most).
@pytest.mark.timeout(300)
def test_every_op_matches_gloo_with_three_ranks(launch):
    _part(launch, "ops_parity.py", "checks ALL OK")


@pytest.mark.timeout(300)
def test_point_to_point_any_peer_irecv_before_isend_and_tags(launch):
    _part(launch, "p2p.py", "p2p ALL OK")


@pytest.mark.timeout(300)
def test_destroy_and_init_again_over_file_tcp_twice_and_env(launch):
    """torch keeps the TCPStore of a port alive after destroy_process_group and names the new
    groups as the old ones: the second group must not read the first one's addresses."""
    _part(launch, "lifecycle.py", "lifecycle ALL OK")
