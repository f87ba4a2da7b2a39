"""Groups that span hosts with several ranks on some: the ranks of a host share memory, the
hosts' first ranks talk over sockets (the ring's leaders' ring, JACCL's leaders' mesh), and
collectives run in stages (local/staged.py).

"Another host" is a real one as far as shared memory can tell: a pid namespace of its own
(unshare: this host's pids mean nothing there), or a network namespace behind a veth link
(ip netns: its own loopback and abstract sockets). The kill -9 cases are in test_shm.py."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import netns
import pytest
from ranks import ANOTHER_HOST, assert_all_ok, collect, jaccl_env, run, spawn

from jacklring_shared.secret_text import drawn_secret_text

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="shared memory is implemented for Linux"),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                       reason="needs root and unshare to put a rank in another pid namespace (another host)"),
]

OPS = "shm/scripts/ops_on_shm.py"
STAGED = {"EXPECT_SHM": "staged", "JACKLRING_LOCAL_TRANSPORT": "auto"}


def elsewhere(*ranks: int) -> dict[int, list[str]]:
    return {r: ANOTHER_HOST for r in ranks}


def backend_env(backend: str, n: int, **extra: str) -> dict[str, str]:
    """STAGED for the ring, or for JACCL (its TCP mesh: jaccl_env), with extra settings."""
    return dict(STAGED, **(jaccl_env(n) if backend == "jaccl" else {}), **extra)


SPANS = [("ring", 3, (2,)), ("ring", 3, (0,)), ("ring", 3, (1,)), ("ring", 4, (1, 3)),
         ("jaccl", 3, (2,)), ("jaccl", 3, (1,))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend,n,away", SPANS,
                         ids=[f"{b}-{n}-ranks-{''.join(map(str, a))}-away" for b, n, a in SPANS])
def test_every_op_and_dtype_when_the_group_spans_hosts(backend, n, away):
    # Rank 0 away: the shared host's first rank is rank 1. Rank 1 away: the shared host holds
    # ranks 0 and 2, not neighbours in the ring. A 64 KiB chunk makes 70001 elements take many
    # chunks on the shared host.
    results = collect(spawn(n, OPS, ["0,1,5,1023,70001"], env=backend_env(backend, n, JACKLRING_SHM_CHUNK_BYTES="64K"),
                            wraps=elsewhere(*away)), timeout=110)
    assert_all_ok(results)
    here = [r for r in range(n) if r not in away]
    for r in results:
        want = f"{backend} ok on stages, " + (f"sharing memory with ranks {here}" if r.rank in here
                                              else "alone on its host")
        assert want in r.stdout, r.stdout


@pytest.mark.timeout(60)
def test_sockets_only_when_asked_even_when_some_ranks_share_a_host():
    assert_all_ok(collect(spawn(3, OPS, ["1,70001"], env={"EXPECT_SHM": "0", "JACKLRING_LOCAL_TRANSPORT": "unix"},
                                wraps=elsewhere(2)), timeout=50))


MISMATCH = ("import numpy as np, sys, adapter\n"
            "g = adapter.init(strict=True)\n"
            "assert g.backend.staging is not None\n"
            "x = np.ones(12, np.float32)\n"
            "try:\n"
            "    CALL\n"
            "    adapter.barrier()\n"  # a rank whose own part succeeded learns it here
            "except adapter.DistributedError as e:\n"
            "    print(type(e).__name__, e)\n"
            "    sys.exit(3)\n")
# (what rank 2, on the other host, calls while ranks 0 and 1 call the first; what the leaders see)
DIFFERENT = {
    "reduce_scatter": ("adapter.reduce_scatter(x) if g.rank() == 2 else adapter.all_sum(x)",
                       ("reduce_scatter(sum", "all_reduce(sum")),
    # Both roots on the first host: the leaders' broadcasts (from that host) look alike.
    "broadcast_root": ("adapter.broadcast(x, root=1 if g.rank() == 2 else 0)", ("broadcast", "root 1")),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
@pytest.mark.parametrize("case", list(DIFFERENT))
def test_hosts_calling_different_collectives_of_one_size_raise_a_mismatch(case, backend):
    # The hosts agree within themselves, and the leaders' collectives alone would look alike: the
    # group's operation and root in the leaders' headers (JACCL: its frames) tell them apart.
    call, words = DIFFERENT[case]
    results = collect(spawn(3, "ring_scripts/exec.py", [MISMATCH.replace("CALL", call)], env=backend_env(backend, 3),
                            wraps=elsewhere(2)), timeout=50)
    for r in results:
        assert r.returncode == 3, r.stdout + r.stderr
    for r in (results[0], results[2]):  # the two hosts' first ranks see the two requests
        assert r.stdout.startswith("MismatchError"), r.stdout
        assert all(word in r.stdout for word in words), r.stdout
    # Told by its host's first rank (a broadcast's root host needs no hand-on from the leader:
    # there rank 1 is done before the leaders compare, and fails at its next collective).
    assert "rank 0" in results[1].stdout, results[1].stdout


@pytest.mark.timeout(60)
def test_a_split_of_a_group_spanning_hosts_stages_only_where_it_still_spans_them():
    body = ("import numpy as np, adapter\n"
            "g = adapter.init(strict=True)\n"
            "sub = g.split(g.rank() % 2)\n"  # {0, 2} share a host; {1, 3} are on two hosts
            "b = sub.backend\n"
            "kind = 'shm' if b.state.shm is not None else 'staged' if b.state.hier is not None else 'sockets'\n"
            "x = adapter.all_sum(np.full(5, g.rank() + 1.0), group=sub)\n"
            "y = adapter.all_sum(np.full(5, g.rank() + 1.0))\n"
            "print(kind, x[0], y[0])\n")
    results = collect(spawn(4, "ring_scripts/exec.py", [body], env=STAGED, wraps=elsewhere(3)), timeout=50)
    assert_all_ok(results)
    kinds = [r.stdout.split() for r in results]
    assert kinds == [["shm", "4.0", "10.0"], ["sockets", "6.0", "10.0"],
                     ["shm", "4.0", "10.0"], ["sockets", "6.0", "10.0"]], kinds


@pytest.mark.timeout(150)
def test_two_hosts_of_two_ranks_each_over_a_real_link():
    # Network namespaces joined by a veth pair: ranks 0 and 1 in one, 2 and 3 in the other, each
    # host's ranks on its address. Every op and dtype, each host on its own shared memory; the
    # ring, then JACCL (its coordinator on the first host's address, its mesh over the link).
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    try:
        with netns.veth_pair("10.211") as pair:
            addresses = [[f"{pair.addresses[r // 2]}:{41000 + r}"] for r in range(4)]
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(addresses, f)
            try:
                wraps = {r: pair.exec_prefix(r // 2) for r in range(4)}
                secret = {"JACKLRING_SECRET": drawn_secret_text()}  # the hostfile spans hosts
                results = collect(spawn(4, OPS, ["0,5,70001"], env=dict(STAGED, **secret), hostfile=f.name,
                                        wraps=wraps), timeout=140)
                jaccl = dict(backend_env("jaccl", 4), MLX_JACCL_COORDINATOR=f"{pair.addresses[0]}:41100",
                             **secret)
                results += collect(spawn(4, OPS, ["0,5,70001"], env=jaccl, hostfile=f.name, wraps=wraps), timeout=140)
                links = collect(spawn(4, "ring_scripts/exec.py", [LINK_FAMILIES], hostfile=f.name, wraps=wraps,
                                      env={"JACKLRING_LOCAL_TRANSPORT": "unix", **secret}), timeout=60)
            finally:
                os.unlink(f.name)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    assert_all_ok(results)
    for r, backend in zip(results, ["ring"] * 4 + ["jaccl"] * 4):
        assert f"{backend} ok on stages, sharing memory with ranks {[0, 1] if r.rank < 2 else [2, 3]}" in r.stdout, \
            r.stdout
    # Sockets between the ranks of a host are Unix sockets, found by address, not by loopback:
    # rank r's link to r + 1 (same namespace for 0 -> 1 and 2 -> 3).
    assert_all_ok(links)
    assert [r.stdout.split() for r in links] == [["unix"], ["tcp"], ["unix"], ["tcp"]], [r.stdout for r in links]


LINK_FAMILIES = ("import socket, adapter\n"
                 "g = adapter.init(strict=True)\n"
                 "print(*['unix' if link.sock.family == socket.AF_UNIX else 'tcp' for link in g.backend.right])\n")


@pytest.mark.timeout(60)
def test_the_whole_group_on_one_host_is_not_staged():
    # The control: the same four ranks, all here, share one segment (no leaders' ring).
    assert_all_ok(run(4, OPS, ["5"], timeout=50, env=dict(STAGED, EXPECT_SHM="1")))
