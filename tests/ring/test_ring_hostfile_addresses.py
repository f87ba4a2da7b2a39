"""Ring hostfiles as schedulers write them (MLX_HOSTFILE set by hand, no launcher): IPv6
loopback, duplicate addresses, many addresses per rank. Two addresses per rank, several
connections and the local transports run the whole backend contract (tests/contract)."""
import json
import time

import pytest
from ranks import assert_all_ok, free_ports, run

from adapter.backends.ring.backend import validate_addresses
from adapter.errors import ConfigError


def _hostfile(tmp_path, data) -> str:
    path = tmp_path / "ring.json"
    path.write_text(json.dumps(data))
    return str(path)


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


@pytest.mark.timeout(60)
def test_split_with_many_addresses_per_rank_keeps_each_interface(tmp_path):
    # Before: the split record was a fixed 256 bytes (ConfigError beyond ~12 addresses per
    # rank) and every sub-ring connection listened on the first address's host only.
    k = 16
    ports = free_ports(2 * k)
    data = [[f"127.0.0.{c + 1}:{ports[i * k + c]}" for c in range(k)] for i in range(2)]
    code = ("import numpy as np, adapter as d\nw = d.init()\ns = w.split(0)\n"
            "hosts = [a.rsplit(':', 1)[0] for a in s.backend.state.addresses[w.rank()]]\n"
            "assert hosts == [f'127.0.0.{c + 1}' for c in range(16)], hosts\n"
            "assert (d.all_sum(np.ones(100_000), group=s) == 2).all()\n")
    assert_all_ok(run(2, "ring_scripts/exec.py", [code], hostfile=_hostfile(tmp_path, data), timeout=50))
