"""A slow but live link is not a dead peer: a 32 MB all_sum over a veth pair rate-limited to
40 Mbit/s (`tc tbf`, about 6 s of transfer) completes with JACKLRING_TIMEOUT=3, because the
deadline measures silence (no byte moved for that long), not the operation's total time; the stall
report says "slow, N MB/s" while bytes flow. Needs root for `ip netns` and `tc`; skipped otherwise."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from cluster import finish_all, rank_envs, reports, start, stop_all
from test_link_cut import netns_pair  # noqa: F401  (the fixture: two namespaces joined by veth)

BODY = """
x = np.ones(8_000_000, np.float32)
all_sum(np.ones(4, np.float32))
start = time.monotonic()
try:
    y = all_sum(x)
    say("DONE", f"{time.monotonic() - start:.2f}", int(y[0]), int(y[-1]))
except ERRORS as e:
    say("ERR", one_line(e))
    sys.exit(3)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["ring", "jaccl"])
def test_slow_link_completes_under_a_short_silence_deadline(tmp_path, netns_pair, backend):  # noqa: F811
    if shutil.which("tc") is None:
        pytest.skip("`tc` (iproute2) is not installed")
    names, links, addresses = netns_pair
    for ns, link in zip(names, links):
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", link, "root", "tbf",
                        "rate", "40mbit", "burst", "32kbit", "latency", "400ms"], check=True, timeout=20)
    envs = rank_envs(backend, 2, tmp_path, hosts=addresses)
    wraps = {r: ["ip", "netns", "exec", names[r]] for r in range(2)}
    # 40 Mbit/s rather than slower: JACCL judges flow by completed frames (1 MiB, about 0.2 s
    # each here) and says "slow" when one completed in the last second; at 10 Mbit/s a frame
    # took about a second, and a loaded host's report could fall between two and say "stalled".
    procs = start(backend, 2, BODY, tmp_path, envs=envs, wraps=wraps,
                  env={"JACKLRING_TIMEOUT": "3", "JACKLRING_STALL_REPORT": "1"})
    try:
        done = [p.wait_line("DONE", 60)[2:] for p in procs]
        codes = finish_all(procs, 20)
    finally:
        stop_all(procs)
    assert codes == [0, 0], reports(procs)
    for took, first, last in done:
        assert (int(first), int(last)) == (2, 2)
        assert float(took) > 3, f"took {took} s: the link was not slower than the deadline"
    stderr = "".join(p.stderr for p in procs)
    assert re.search(r"is slow, \d+\.\d+ MB/s", stderr), stderr
    assert "is stalled" not in stderr, stderr
    print(backend, [d[0] for d in done], re.findall(r".*is slow, .*", stderr)[:1])
