"""JACKLRING_VERIFY=mac against a relay that rewrites data and recomputes checksums: the CRC
mode (meant for accidents) is fooled, the MAC mode raises IntegrityError; never a silent
wrong result. Real sockets, a real relay thread between two Links."""
from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from adapter.backends.transport import auth, integrity
from adapter.backends.transport.stream_engine import Engine, Stream
from adapter.errors import IntegrityError

ONE, THOUSAND = struct.pack("<f", 1.0), struct.pack("<f", 1000.0)
JOB = auth.auth_from_secret(b"s" * 32)


def relay(src: socket.socket, dst: socket.socket, size: int, trailer: int, mode: str) -> None:
    """Forward one message, rewriting 1.0 into 1000.0; recompute a CRC trailer when it can."""
    data = b""
    while len(data) < size + trailer:
        data += src.recv(size + trailer - len(data))
    body = data[:size].replace(ONE, THOUSAND)
    tail = integrity.CRC.pack(integrity.crc(body)) if mode == "crc" else data[size:]
    dst.sendall(body + tail)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["crc", "mac"])
def test_tampering_relay(mode):
    a, relay_in = socket.socketpair()
    relay_out, b = socket.socketpair()
    sender = Stream(a, 1, "rank 1", integrity.for_link(mode, JOB, 9, 0, 1, "ring 0->1 #0"))
    receiver = Stream(b, 0, "rank 0", integrity.for_link(mode, JOB, 9, 1, 0, "ring 0->1 #0"))
    data = np.ones(1024, np.float32)
    out = np.zeros_like(data)
    size = data.nbytes
    thread = threading.Thread(target=relay, args=(relay_in, relay_out, size, receiver.verify.size, mode))
    thread.start()
    sender.post_send(memoryview(data).cast("B"))
    receiver.post_recv(memoryview(out).cast("B"))
    engine = Engine([sender, receiver], 0)
    if mode == "crc":
        engine.run(time.monotonic() + 10, "test")
        assert out[0] == 1000.0  # CRC guards against accidents only: documented, not a defence
    else:
        with pytest.raises(IntegrityError, match="MAC does not match"):
            engine.run(time.monotonic() + 10, "test")
    thread.join(5)


def test_mac_catches_replay_and_reorder():
    send = integrity.for_link("mac", JOB, 9, 0, 1, "p2p 0->1")
    recv = integrity.for_link("mac", JOB, 9, 1, 0, "p2p 0->1")
    first, second = send.seal(b"a"), send.seal(b"b")
    assert recv.check(b"a", first) is None
    assert recv.check(b"a", first) is not None  # replayed
    other = integrity.for_link("mac", JOB, 9, 1, 0, "p2p 0->1")
    assert other.check(b"b", second) is not None  # out of order
    wrong_key = integrity.for_link("mac", auth.auth_from_secret(b"t" * 32), 9, 1, 0, "p2p 0->1")
    assert wrong_key.check(b"a", first) is not None


@pytest.mark.timeout(60)
def test_ring_collectives_and_p2p_with_verify_mac(tmp_path):
    from faults.cluster import finish_all, reports, start, stop_all
    body = """
for size in (10, 100_000, 1_000_000):
    x = all_sum(np.full(size, r + 1.0, np.float32))
    assert (x == n * (n + 1) / 2).all(), x[:4]
g = all_gather(np.full(3, r, np.int64))
assert g.tolist() == [q for q in range(n) for _ in range(3)]
for i in range(3):
    if r == 0:
        send(np.full(50_000, i, np.float64), 1)
    elif r == 1:
        assert (recv((50_000,), np.float64, 0) == i).all()
barrier()
say("OK")
"""
    env = {"JACKLRING_VERIFY": "mac", "JACKLRING_SECRET": "ab" * 32, "JACKLRING_REQUIRE_AUTH": "1"}
    procs = start("ring", 3, body, tmp_path, env=env)
    try:
        codes = finish_all(procs, 50)
    finally:
        stop_all(procs)
    assert codes == [0, 0, 0], reports(procs)
