"""The log-latency schedules through the real backends: ring ranks over TCP on 127.0.0.1 and
JACCL's TCP mesh, never shared memory (JACKLRING_LOCAL_TRANSPORT=tcp), at group sizes 2 to 8.
Every rank's result must have the same bits, the bits recursive doubling's documented order
gives (a linear order gives others: test_schedules.py), and the same again on a second call."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import ranks
from alg_values import contribution, doubling_sum, linear_sum

from adapter.backends.algorithms.selection import Chooser

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {"JACKLRING_LOCAL_TRANSPORT": "tcp", "JACKLRING_TIMEOUT": "30", "JACKLRING_CONNECT_TIMEOUT": "30"}


def _run(n: int, backend: str, tmp_path) -> list[dict]:
    env = dict(ENV, **(ranks.jaccl_env(n, str(tmp_path)) if backend == "jaccl" else {}))
    outs = [str(tmp_path / f"rank{r}.json") for r in range(n)]
    # One hostfile for every rank; each rank gets its own output path.
    hostfile = ranks.ring_hostfile(n, directory=str(tmp_path))
    procs = []
    for r in range(n):
        procs += ranks.spawn(n, os.path.join(HERE, "schedules_worker.py"), [backend, outs[r]], env=env,
                             hostfile=hostfile, ranks=[r])
    ranks.assert_all_ok(ranks.collect(procs, timeout=90))
    found = []
    for path in outs:
        with open(path) as f:
            found.append(json.load(f))
    return found


def _check(n: int, found: list[dict]) -> None:
    rd = doubling_sum(n, 64).tobytes().hex()
    if n >= 4:  # (2 and 3 ranks: recursive doubling's tree is the rank order)
        assert rd != linear_sum(n, 64).tobytes().hex()
    for r, got in enumerate(found):
        assert got["rd/all_sum"] == rd, f"rank {r} of {n}: recursive doubling gave other bits than its documented order"
        assert got["rd/again"] == rd
        assert got["rh/all_sum"] == found[0]["rh/all_sum"] == got["rh/again"], f"rank {r} of {n}: Rabenseifner's bits differ"
        assert got["gather"] == [10 * q + i for q in range(n) for i in range(3)]
        total = np.arange(2 * n, dtype=np.float64) * sum(range(1, n + 1))
        assert got["scatter"] == total[2 * r:2 * r + 2].tolist()
        assert got["bcast"] == [float(n - 1)] * 4
    rh = np.frombuffer(bytes.fromhex(found[0]["rh/all_sum"]), np.float32)
    exact = sum(contribution(q, 1000).astype(np.float64) for q in range(n))
    np.testing.assert_allclose(rh, exact, rtol=1e-4, atol=1e-3)  # float32 sums of terms up to 4**4


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8])
def test_ring_schedules_give_identical_bits(n: int, tmp_path) -> None:
    _check(n, _run(n, "ring", tmp_path))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [3, 5, 8])
def test_jaccl_mesh_schedules_give_identical_bits(n: int, tmp_path) -> None:
    found = _run(n, "jaccl", tmp_path)
    assert found[0]["backend"] == "jaccl"
    _check(n, found)


def test_the_table_chooses_log_latency_where_the_steps_are_fewer(monkeypatch) -> None:
    monkeypatch.delenv("JACKLRING_ALGORITHM", raising=False)
    assert Chooser("ring", 8).choose("all_reduce", 4) == "rd"
    assert Chooser("ring", 4).choose("all_reduce", 4) == "native"  # measured: rd lost at 4 hosts
    assert Chooser("ring", 4).choose("all_reduce", 64 << 10) == "rh"
    assert Chooser("ring", 5).choose("all_reduce", 64 << 10) == "native"  # folding: as many steps as the ring
    assert Chooser("ring", 8).choose("all_reduce", 64 << 20) == "native"  # bandwidth: the pipelined ring
    monkeypatch.setenv("JACKLRING_ALGORITHM", "all_reduce=native, broadcast=tree")
    assert Chooser("ring", 8).choose("all_reduce", 4) == "native"
    assert Chooser("jaccl", 2).choose("broadcast", 1 << 30) == "tree"


@pytest.mark.parametrize("raw, words", [("all_reduce=fast", "all_reduce takes one of auto, native, rd, rh"),
                                        ("allreduce=rd", "the collective one of"),
                                        ("all_reduce", "give collective=schedule pairs"),
                                        ("all_reduce=rd,all_reduce=rh", "names all_reduce twice")])
def test_a_wrong_setting_is_a_config_error_naming_it(raw: str, words: str, monkeypatch) -> None:
    from adapter.errors import ConfigError
    monkeypatch.setenv("JACKLRING_ALGORITHM", raw)
    with pytest.raises(ConfigError, match="JACKLRING_ALGORITHM") as caught:
        Chooser("ring", 4)
    assert words in str(caught.value)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
def test_a_dead_peer_is_named_within_seconds(backend: str, tmp_path) -> None:
    """The last of 4 ranks exits; recursive doubling pairs rank 3 with rank 2 first: every
    survivor fails with an error naming rank 3 (rank 2 directly, the others through the
    failure that spreads), well before the 30 s deadline."""
    n = 4
    env = dict(ENV, JACKLRING_ALGORITHM="all_reduce=rd", **(ranks.jaccl_env(n, str(tmp_path)) if backend == "jaccl" else {}))
    hostfile = ranks.ring_hostfile(n, directory=str(tmp_path))
    outs = [str(tmp_path / f"rank{r}.json") for r in range(n)]
    procs = []
    for r in range(n):
        procs += ranks.spawn(n, os.path.join(HERE, "dead_peer_worker.py"), [backend, outs[r]], env=env,
                             hostfile=hostfile, ranks=[r])
    ranks.assert_all_ok(ranks.collect(procs, timeout=90))
    for r in range(n - 1):
        with open(outs[r]) as f:
            got = json.load(f)
        assert "raised" in got, f"rank {r}: all_sum returned with a rank gone"
        assert "rank 3" in got["message"], f"rank {r} does not name rank 3: {got['message']}"
        assert f"rank {r}" in got["message"], f"rank {r} does not name itself: {got['message']}"
        assert got["seconds"] < 15, f"rank {r} took {got['seconds']:.1f} s: {got['message']}"


@pytest.mark.timeout(150)
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare to put a rank in another pid namespace (another host)")
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
def test_hosts_with_several_ranks_stage_and_their_leaders_run_the_schedule(backend: str, tmp_path) -> None:
    """5 ranks on 4 hosts (ranks 0 and 1 share one): the host's shared memory adds ranks 0 and 1,
    then the 4 leaders run recursive doubling, (h0 + x2) + (x3 + x4), whose bits a linear order
    among the leaders, ((h0 + x2) + x3) + x4, would not give."""
    n = 5
    env = dict(ENV, JACKLRING_LOCAL_TRANSPORT="auto", JACKLRING_ALGORITHM="all_reduce=rd",
               **(ranks.jaccl_env(n, str(tmp_path)) if backend == "jaccl" else {}))
    hostfile = ranks.ring_hostfile(n, directory=str(tmp_path))
    outs = [str(tmp_path / f"rank{r}.json") for r in range(n)]
    procs = []
    for r in range(n):
        procs += ranks.spawn(n, os.path.join(HERE, "staged_worker.py"), [backend, outs[r]], env=env,
                             hostfile=hostfile, ranks=[r], wraps={r: ranks.ANOTHER_HOST} if r >= 2 else None)
    ranks.assert_all_ok(ranks.collect(procs, timeout=120))
    x = [contribution(r, 64) for r in range(n)]
    want = (((x[0] + x[1]) + x[2]) + (x[3] + x[4])).tobytes().hex()
    linear = ((((x[0] + x[1]) + x[2]) + x[3]) + x[4]).tobytes().hex()
    assert want != linear
    for r, path in enumerate(outs):
        with open(path) as f:
            got = json.load(f)
        assert got["staged"], f"rank {r} did not run in stages"
        assert got["sum"] == want, f"rank {r}: the leaders did not run recursive doubling (or not in its order)"


@pytest.mark.timeout(150)
def test_dist_all_reduce_makes_the_same_choice(tmp_path) -> None:
    """4 ranks of the jacklring torch process group over TCP with JACKLRING_ALGORITHM=all_reduce=rd:
    dist.all_reduce goes through the ring backend's choice (recursive doubling's bits say so)."""
    pytest.importorskip("torch")
    n = 4
    port = ranks.free_ports(1)[0]
    outs = [str(tmp_path / f"rank{r}.json") for r in range(n)]
    env = dict(os.environ, **ENV, PYTHONPATH=os.path.dirname(HERE) + "/..", PYTHONUNBUFFERED="1")
    env["JACKLRING_ALGORITHM"] = "all_reduce=rd"
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "torch_worker.py"), str(r), str(n), str(port), outs[r]],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    ranks.assert_all_ok(ranks.collect(procs, timeout=120))
    want = doubling_sum(n, 64).tobytes().hex()
    assert want != linear_sum(n, 64).tobytes().hex()
    for r, path in enumerate(outs):
        with open(path) as f:
            assert json.load(f)["sum"] == want, f"rank {r}: dist.all_reduce did not run recursive doubling"


@pytest.mark.timeout(150)
def test_a_rank_that_never_calls_is_named_by_every_survivor(tmp_path) -> None:
    """4 ring ranks, recursive doubling forced, rank 2 alive but never in the all_sum: rank 3
    waits for it in step 0, ranks 0 and 1 wait for ranks 2 and 3 in step 1. Every survivor names
    rank 2 at the deadline: rank 3 tells its schedule's partners it is stuck on rank 2, though
    rank 1 never reached it before (point_to_point.py's expected partners)."""
    n = 4
    env = dict(ENV, JACKLRING_ALGORITHM="all_reduce=rd", JACKLRING_TIMEOUT="3")
    hostfile = ranks.ring_hostfile(n, directory=str(tmp_path))
    outs = [str(tmp_path / f"rank{r}.json") for r in range(n)]
    procs = []
    for r in range(n):
        procs += ranks.spawn(n, os.path.join(HERE, "dead_peer_worker.py"), ["ring", outs[r], "absent"], env=env,
                             hostfile=hostfile, ranks=[r])
    ranks.assert_all_ok(ranks.collect(procs, timeout=90))
    for r in (0, 1, 3):
        with open(outs[r]) as f:
            got = json.load(f)
        assert "raised" in got, f"rank {r}: all_sum returned without rank 2"
        assert "rank 2 is the rank that went silent" in got["message"], f"rank {r}: {got['message']}"
        assert got["seconds"] < 3 + 3, f"rank {r} took {got['seconds']:.1f} s: {got['message']}"
