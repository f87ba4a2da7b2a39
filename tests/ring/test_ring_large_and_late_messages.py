"""Ring messages at the edges of size and time: a few hundred megabytes in one all_sum, and a
recv from a live rank that never sends (a deadline, not a lost peer)."""
import pytest
from ranks import assert_all_ok, run


@pytest.mark.timeout(120)
def test_a_few_hundred_megabytes():
    code = ("import numpy as np, adapter\n"
            "g = adapter.init(strict=True)\n"
            "x = np.full(64 * 1024 * 1024, g.rank() + 1, np.float32)  # 256 MiB\n"
            "y = adapter.all_sum(x)\n"
            "assert y[0] == 3 and y[-1] == 3 and (y == 3).all()\n"
            "print('ok')\n")
    assert_all_ok(run(2, "ring_scripts/exec.py", [code], timeout=110))


@pytest.mark.timeout(60)
def test_recv_from_a_live_rank_that_never_sends_is_a_timeout():
    # Before: PeerError ("never connected"), although the peer was alive and only late.
    # Rank 1 stays alive for 4 s, or until rank 0 has raised (a file beside the hostfile says so).
    code = ("import os, sys, time, numpy as np, adapter as d\nw = d.init()\n"
            "raised = os.environ['MLX_HOSTFILE'] + '.raised'\n"
            "if w.rank() == 1:\n    until = time.monotonic() + 4\n"
            "    while not os.path.exists(raised) and time.monotonic() < until:\n        time.sleep(0.05)\n"
            "    sys.exit(0)\n"
            "try:\n    d.recv((3,), np.float32, 1)\n"
            "except d.CollectiveTimeout as e:\n    print('TIMEOUT', e)\n    open(raised, 'w').close()\n    sys.exit(3)\n")
    res = run(2, "ring_scripts/exec.py", [code], env={"JACKLRING_TIMEOUT": "1"}, timeout=50)
    assert res[0].returncode == 3 and "TIMEOUT" in res[0].stdout, res[0].stdout + res[0].stderr
    assert "rank 0" in res[0].stdout and "rank 1" in res[0].stdout
    assert res[1].returncode == 0, res[1].stderr
