"""A link cut mid-run: two ranks in network namespaces joined by a veth pair; the link is set
down while collectives loop. A downed link sends no FIN or RST, so the ranks learn of it only
from their deadline: each must raise (CollectiveTimeout or PeerError) within JACKLRING_TIMEOUT,
never hang. Needs root (CAP_NET_ADMIN) for `ip netns`; skipped otherwise."""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import time

import pytest
from cluster import finish_all, rank_envs, reports, start, stop_all

OP_TIMEOUT_S = 3.0
SLACK_S = 3.0


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


@pytest.fixture
def netns_pair():
    """Two fresh namespaces joined by a veth pair with 10.199.X.1/30 and .2/30 inside them;
    removed afterwards even on failure. Yields (namespaces, interfaces, addresses)."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN)")
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    names = [f"jkf{tag}a", f"jkf{tag}b"]
    links = [f"jkv{tag}a", f"jkv{tag}b"]
    subnet = random.randrange(256)
    addresses = [f"10.199.{subnet}.1", f"10.199.{subnet}.2"]
    created = []
    try:
        for ns in names:
            made = ip("netns", "add", ns, check=False)
            if made.returncode != 0:
                pytest.skip(f"`ip netns add` is not permitted here: {made.stderr.strip()}")
            created.append(ns)
        ip("link", "add", links[0], "netns", names[0], "type", "veth", "peer", "name", links[1], "netns", names[1])
        for ns, link, addr in zip(names, links, addresses):
            ip("-n", ns, "addr", "add", f"{addr}/30", "dev", link)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", link, "up")
        yield names, links, addresses
    finally:
        for ns in created:
            ip("netns", "del", ns, check=False)  # deleting a namespace deletes its veth end


BODY = """
small, big = np.ones(16, np.float32), np.ones(256_000, np.float32)
all_sum(small)
say("READY")
until = time.monotonic() + 40
i = 0
try:
    while time.monotonic() < until:
        assert (all_sum(small if i % 2 else big)[:4] == n).all()
        i += 1
except ERRORS as e:
    say("ERR", one_line(e))
    sys.exit(3)
say("NOERR")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
def test_link_down_mid_run_raises_within_the_op_deadline(tmp_path, netns_pair, backend):
    names, links, addresses = netns_pair
    envs = rank_envs(backend, 2, tmp_path, hosts=addresses)
    wraps = {r: ["ip", "netns", "exec", names[r]] for r in range(2)}
    procs = start(backend, 2, BODY, tmp_path, envs=envs, wraps=wraps,
                  env={"JACKLRING_TIMEOUT": str(OP_TIMEOUT_S), "JACKLRING_STALL_REPORT": "0"})
    try:
        for p in procs:
            p.wait_line("READY", 30)
        time.sleep(0.5)
        cut_at = time.monotonic()
        ip("-n", names[0], "link", "set", links[0], "down")
        results = {}
        for p in procs:
            fields = p.wait_line("ERR", OP_TIMEOUT_S + 20)
            results[p.rank] = (float(fields[1]) - cut_at, " ".join(fields[2:]))
        codes = finish_all(procs, 10)
    finally:
        stop_all(procs)
    assert codes == [3, 3], reports(procs)
    for rank, (elapsed, text) in results.items():
        assert text.split()[0] in ("CollectiveTimeout", "PeerError"), text
        assert elapsed < OP_TIMEOUT_S + SLACK_S, f"rank {rank} raised {elapsed:.1f} s after the cut: {text}"
        assert f"rank {1 - rank}" in text, text
    print(f"{backend}: {results}")
