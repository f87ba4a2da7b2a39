"""Adversarial review of the public API on the ring, as an independent checker would run it:
spec-style scripts under a scheduler's MLX_RANK / MLX_HOSTFILE (several addresses per rank),
edge-case inputs, dtype extremes, split variants, threads, use after close."""
import json
import time
import warnings

import numpy as np
import pytest
from ranks import assert_all_ok, free_ports, run

from adapter.backends.base import ReduceOp
from adapter.backends.elements import BFLOAT16, reduce_into, reduce_many
from adapter.backends.ring.backend import validate_addresses
from adapter.errors import ConfigError


def _hostfile(tmp_path, data) -> str:
    path = tmp_path / "ring.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("n, env", [(2, {}), (4, {}),
                                    # every size through the two-phase pipelined path, tiny segments
                                    (3, {"JACKLRING_RING_SMALL_BYTES": "0", "JACKLRING_RING_SEGMENT_BYTES": "4096"})])
def test_review_script_with_two_addresses_per_rank(tmp_path, n, env):
    ports = free_ports(2 * n)
    data = [[f"127.0.0.1:{ports[2 * i]}", f"127.0.0.2:{ports[2 * i + 1]}"] for i in range(n)]
    assert_all_ok(run(n, "ring_scripts/review.py", hostfile=_hostfile(tmp_path, data), timeout=180, env=env))


@pytest.mark.timeout(60)
def test_ipv6_loopback_hostfile(tmp_path):
    import socket
    socks = []
    try:
        for _ in range(4):
            socks.append(socket.socket(socket.AF_INET6))
            socks[-1].bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback (::1)")
    finally:
        ports = [s.getsockname()[1] for s in socks if s.getsockname()[1]]
        for s in socks:
            s.close()
    data = [[f"[::1]:{ports[0]}", f"[::1]:{ports[1]}"], [f"[::1]:{ports[2]}", f"[::1]:{ports[3]}"]]
    code = ("import numpy as np, adapter as d\nw = d.init()\n"
            "assert (d.all_sum(np.ones(3)) == 2).all() and (d.all_sum(np.ones(100_000)) == 2).all()\n"
            "s = w.split(0)\nassert d.all_sum(np.ones(2), group=s)[0] == 2\n"
            "d.send(np.ones(2), 1 - w.rank())\nassert (d.recv((2,), 'float64', 1 - w.rank()) == 1).all()\n")
    assert_all_ok(run(2, "ring_scripts/exec.py", [code], hostfile=_hostfile(tmp_path, data), timeout=50))


def test_duplicate_addresses_are_a_config_error_naming_both_ranks():
    # Before: one rank failed to listen and the other waited the whole connect deadline (120 s).
    with pytest.raises(ConfigError, match="rank 0 and rank 1.*127.0.0.1:5000"):
        validate_addresses([["127.0.0.1:5000"], ["127.0.0.1:5000"]], "hostfile")
    with pytest.raises(ConfigError, match="rank 1 and rank 1"):
        validate_addresses([["127.0.0.1:5000"], ["127.0.0.1:5001", "127.0.0.1:5001"]], "hostfile")
    with pytest.raises(ConfigError, match=r"\[::1\]:7"):
        validate_addresses([["[::1]:7"], ["::1:7"]], "hostfile")
    # port 0 (any free port) may repeat; the same port on different hosts is fine
    validate_addresses([["127.0.0.1:0"], ["127.0.0.1:0"]], "hostfile")
    validate_addresses([["127.0.0.1:5000"], ["127.0.0.2:5000"]], "hostfile")


@pytest.mark.timeout(30)
def test_duplicate_addresses_fail_fast_on_every_rank(tmp_path):
    port = free_ports(1)[0]
    path = _hostfile(tmp_path, [[f"127.0.0.1:{port}"], [f"127.0.0.1:{port}"]])
    start = time.monotonic()
    res = run(2, "ring_scripts/exec.py", ["import adapter\nadapter.init()\n"], hostfile=path, timeout=25)
    assert time.monotonic() - start < 20
    for r in res:
        assert r.returncode != 0 and "ConfigError" in r.stderr and "both listen on" in r.stderr, r.stderr


def test_float_overflow_to_inf_is_silent():
    # IEEE overflow to inf is the right answer, not a reason to print numpy warnings from the library.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dt in (np.float16, BFLOAT16, np.float32):
            big = np.full(3, 6e4 if dt == np.float16 else 3e38, dt)
            out = np.empty_like(big)
            reduce_into(out, big, big, ReduceOp.SUM)
            assert np.isinf(out.astype(np.float32)).all()
            reduce_many(out, [big, big, big], ReduceOp.SUM)
            assert np.isinf(out.astype(np.float32)).all()
        inf = np.array([np.inf], np.float64)
        reduce_into(inf.copy(), inf, -inf, ReduceOp.SUM)  # inf - inf = nan, silently


@pytest.mark.timeout(60)
def test_split_with_many_addresses_per_rank_keeps_each_interface(tmp_path):
    # Before: the split record was a fixed 256 bytes (ConfigError beyond ~12 addresses per
    # rank) and every sub-ring connection listened on the first address's host only.
    k = 16
    ports = free_ports(2 * k)
    data = [[f"127.0.0.{c + 1}:{ports[i * k + c]}" for c in range(k)] for i in range(2)]
    code = ("import numpy as np, adapter as d\nw = d.init()\ns = w.split(0)\n"
            "hosts = [a.rsplit(':', 1)[0] for a in s.backend._addresses[w.rank()]]\n"
            "assert hosts == [f'127.0.0.{c + 1}' for c in range(16)], hosts\n"
            "assert (d.all_sum(np.ones(100_000), group=s) == 2).all()\n")
    assert_all_ok(run(2, "ring_scripts/exec.py", [code], hostfile=_hostfile(tmp_path, data), timeout=50))


@pytest.mark.timeout(60)
def test_recv_from_a_live_rank_that_never_sends_is_a_timeout():
    # Before: PeerError ("never connected"), although the peer was alive and only late.
    code = ("import sys, time, numpy as np, adapter as d\nw = d.init()\n"
            "if w.rank() == 1:\n    time.sleep(4)\n    sys.exit(0)\n"
            "try:\n    d.recv((3,), np.float32, 1)\n"
            "except d.CollectiveTimeout as e:\n    print('TIMEOUT', e)\n    sys.exit(3)\n")
    res = run(2, "ring_scripts/exec.py", [code], env={"JACKLRING_TIMEOUT": "1"}, timeout=50)
    assert res[0].returncode == 3 and "TIMEOUT" in res[0].stdout, res[0].stdout + res[0].stderr
    assert "rank 0" in res[0].stdout and "rank 1" in res[0].stdout
    assert res[1].returncode == 0, res[1].stderr
