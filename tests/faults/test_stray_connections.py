"""Garbage or a wrong peer on a listening port: random bytes, a well-formed handshake with the
wrong job token or the wrong rank, a connection that sends nothing. Each is rejected (and logged)
and the job forms and runs as if it had not happened."""
from __future__ import annotations

import json
import random
import socket
import time
import zlib

import pytest
from cluster import finish_all, rank_envs, reports, start, stop_all

from adapter.backends.jaccl import config as jaccl_config
from adapter.backends.jaccl.side_channel import PURPOSE_SIDE_CHANNEL
from adapter.backends.ring.backend import PURPOSE_P2P, PURPOSE_RING
from adapter.backends.transport import auth, tcp

BODY = """
assert (all_sum(np.ones(5)) == n).all()
say("FORMED")
go = os.path.join(os.environ["FAULT_DIR"], "go")
until = time.monotonic() + 30
while not os.path.exists(go) and time.monotonic() < until:
    time.sleep(0.02)
if r == 0:
    send(np.arange(10.0), 1)
if r == 1:
    assert np.array_equal(recv((10,), np.float64, 0), np.arange(10.0))
assert (all_sum(np.ones(100_000, np.float32)) == n).all()
say("OK")
"""


def dial(address: str, timeout: float = 20) -> socket.socket:
    """Connect to a port the job is (about to be) listening on."""
    host, port = tcp.parse_address(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection((host, port), timeout=1)
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {address}"
            time.sleep(0.05)


def strays(address: str, purpose: int, token: int, silent: bool) -> list[socket.socket]:
    """Open the stray connections; returns them (kept open until the job is done)."""
    rng = random.Random(7)
    wrong_token = (token + 1 + rng.getrandbits(32)) % (1 << 64)
    payloads = [
        bytes(rng.getrandbits(8) for _ in range(64)),                      # random bytes
        b"GET / HTTP/1.0\r\n\r\n" + b"x" * 32,                             # another protocol
        tcp.Hello(purpose, 1, 0, 0, wrong_token).pack(),                   # another job
        tcp.Hello(purpose, 7, 0, 0, token).pack(),                         # no such sender rank
        tcp.Hello(purpose, 1, 5, 0, token).pack(),                         # meant for rank 5
        tcp.Hello(0x7777, 1, 0, 0, token).pack(),                          # unknown purpose
        tcp.Hello(purpose, 1, 0, 0, token).pack()[:10],                    # cut short, then closed
    ]
    socks = []
    for data in payloads:
        s = dial(address)
        s.sendall(data)
        socks.append(s)
    socks[-1].close()
    if silent:
        socks.append(dial(address))  # sends nothing: dropped after handshake.HANDSHAKE_TIMEOUT_S, beside the job
    return socks


def run_with_strays(backend: str, tmp_path, address: str, purpose: int, token: int, envs) -> float:
    env = {"FAULT_DIR": str(tmp_path)}
    first = start(backend, 2, BODY, tmp_path, envs=envs, ranks=[0], env=env)
    socks = []
    try:
        t0 = time.monotonic()
        socks = strays(address, purpose, token, silent=True)
        procs = first + start(backend, 2, BODY, tmp_path, envs=envs, ranks=[1], env=env)
        for p in procs:
            p.wait_line("FORMED", 40)
        formed_after = time.monotonic() - t0
        if backend == "ring":  # strays on a port of a running job, met by recv()'s accept
            ring_addresses = json.loads((tmp_path / "ring-hosts.json").read_text())
            socks += strays(ring_addresses[1][0], PURPOSE_P2P, token, silent=False)
        (tmp_path / "go").touch()
        for p in procs:
            p.wait_line("OK", 30)
        codes = finish_all(procs, 20)
    finally:
        for s in socks:
            s.close()
        stop_all(first)
        stop_all(procs if "procs" in locals() else [])
    assert codes == [0, 0], reports(procs)
    # Connections that are merely silent (or stop after a plausible hello) are dropped after
    # one second; the job may well have finished by then, so only the others are counted.
    rejected = procs[0].stderr.count("unauthenticated connection from")
    assert rejected >= 6, reports(procs)
    if backend == "ring":
        assert procs[1].stderr.count("unauthenticated connection from") >= 5, reports(procs)
    return formed_after


@pytest.mark.timeout(60)
def test_ring_rejects_strays_before_and_during_the_job(tmp_path):
    envs = rank_envs("ring", 2, tmp_path)
    addresses = json.loads((tmp_path / "ring-hosts.json").read_text())
    token = auth.context_id(json.dumps(addresses).encode())
    formed = run_with_strays("ring", tmp_path, addresses[0][0], PURPOSE_RING, token, envs)
    print(f"ring formed {formed:.1f} s after the strays (silent connections are handled beside the job)")


@pytest.mark.timeout(60)
def test_jaccl_coordinator_rejects_strays(tmp_path):
    envs = rank_envs("jaccl", 2, tmp_path)
    coordinator = envs[0]["MLX_JACCL_COORDINATOR"]
    devices = jaccl_config.parse_devices((tmp_path / "jaccl-devices.json").read_text(), "test")
    token = zlib.crc32(json.dumps([coordinator, devices]).encode())
    formed = run_with_strays("jaccl", tmp_path, coordinator, PURPOSE_SIDE_CHANNEL, token, envs)
    print(f"jaccl formed {formed:.1f} s after the strays (silent connections are handled beside the job)")


@pytest.mark.timeout(60)
def test_ring_one_idle_connection_does_not_use_up_the_connect_deadline(tmp_path):
    envs = rank_envs("ring", 2, tmp_path)
    address = json.loads((tmp_path / "ring-hosts.json").read_text())[0][0]
    # A listener that waited on the idle connection would wait until the deadline, however long
    # it is, so the test fails then at any length; 8 s leaves room for rank 1's start under load.
    env = {"JACKLRING_CONNECT_TIMEOUT": "8"}
    procs = start("ring", 2, "say('FORMED')", tmp_path, envs=envs, ranks=[0], env=env)
    idle = dial(address)
    try:
        procs += start("ring", 2, "say('FORMED')", tmp_path, envs=envs, ranks=[1], env=env)
        codes = finish_all(procs, 30)
    finally:
        idle.close()
        stop_all(procs)
    assert codes == [0, 0], reports(procs)
