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

from adapter.backends.transport import auth, integrity, tcp
from adapter.backends.transport.stream_engine import Engine, Stream
from adapter.errors import IntegrityError

ONE, THOUSAND = struct.pack("<f", 1.0), struct.pack("<f", 1000.0)
JOB = auth.auth_from_secret(b"s" * 32)
SESSION = bytes(range(64))  # both handshake nonces of the connection


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
    sender = Stream(a, 1, "rank 1", integrity.for_link(mode, JOB, 9, 0, 1, "ring 0->1 #0", SESSION))
    receiver = Stream(b, 0, "rank 0", integrity.for_link(mode, JOB, 9, 1, 0, "ring 0->1 #0", SESSION))
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
    send = integrity.for_link("mac", JOB, 9, 0, 1, "p2p 0->1", SESSION)
    recv = integrity.for_link("mac", JOB, 9, 1, 0, "p2p 0->1", SESSION)
    first, second = send.seal(b"a"), send.seal(b"b")
    assert recv.check(b"a", first) is None
    assert recv.check(b"a", first) is not None  # replayed
    other = integrity.for_link("mac", JOB, 9, 1, 0, "p2p 0->1", SESSION)
    assert other.check(b"b", second) is not None  # out of order
    wrong_key = integrity.for_link("mac", auth.auth_from_secret(b"t" * 32), 9, 1, 0, "p2p 0->1", SESSION)
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


# ---- MAC keys belong to one connection: its handshake's two nonces ----------------------------

PURPOSE_RING = 1


def _handshake(listener: tcp.Listener, token: int):
    """One real authenticated connection rank 0 -> rank 1 (same job, purpose and ranks every
    time, as in a re-run of the job with the same secret and addresses): (client socket, the
    connector's hello, server socket, the acceptor's hello)."""
    deadline = time.monotonic() + 10
    client, sent = tcp.connect_with_hello(listener.getsockname()[:2], tcp.Hello(PURPOSE_RING, 0, 1, 0, token),
                                          deadline, "rank 1", JOB)
    server, got = listener.take(lambda h: True, deadline, "rank 0")
    return client, sent, server, got


@pytest.fixture(name="listener")
def listener_fixture():
    listener = tcp.Listener("127.0.0.1", 0, local=False)
    listener.serve(JOB, 77, 1, lambda hello: None, "rank 1")
    yield listener
    listener.close()


@pytest.mark.timeout(30)
def test_both_ends_of_a_connection_share_its_nonces_and_no_two_connections_do(listener):
    first = _handshake(listener, 77)
    second = _handshake(listener, 77)
    try:
        for _, sent, _, got in (first, second):
            assert len(sent.session) == 64 and sent.session == got.session
        assert first[1].session != second[1].session
        keys = [integrity.for_link("mac", JOB, 77, 0, 1, "ring 0->1 #0", c[1].session)._send_key for c in (first, second)]
        assert keys[0] != keys[1]
    finally:
        for c in (first, second):
            c[0].close()
            c[2].close()


def _record(client: socket.socket, server: socket.socket, seal: integrity.Integrity, messages: list[bytes]) -> bytes:
    """What a tap on the wire sees when `messages` are sent through a real engine."""
    sender = Stream(client, 1, "rank 1", seal)
    for m in messages:
        sender.post_send(memoryview(m))
    Engine([sender], 0).run(time.monotonic() + 10, "test")
    want = sum(len(m) + seal.size for m in messages)
    data = b""
    while len(data) < want:
        data += server.recv(want - len(data))
    return data


def _receive(server: socket.socket, check: integrity.Integrity, sizes: list[int]) -> list[bytes]:
    receiver = Stream(server, 0, "rank 0", check)
    outs = [bytearray(n) for n in sizes]
    for o in outs:
        receiver.post_recv(memoryview(o))
    Engine([receiver], 1).run(time.monotonic() + 10, "test")
    return [bytes(o) for o in outs]


@pytest.mark.timeout(30)
def test_a_stream_recorded_on_one_connection_is_rejected_on_another(listener):
    """An on-path attacker records a connection of one run of the job, then plays it into a
    connection of a later run (same secret, addresses, ranks and purpose, so the same job
    context): the receiver raises IntegrityError. The recording itself is sound: played to a
    receiver keyed for the recorded connection it checks."""
    messages = [np.full(1000, 1.0, np.float32).tobytes(), np.full(10, 2.0, np.float64).tobytes()]
    sizes = [len(m) for m in messages]
    c1, sent1, s1, got1 = _handshake(listener, 77)
    c2, sent2, s2, got2 = _handshake(listener, 77)
    try:
        recording = _record(c1, s1, integrity.for_link("mac", JOB, 77, 0, 1, "ring 0->1 #0", sent1.session), messages)
        # control: the same bytes into a fresh socket, checked with connection 1's receiving keys
        a, b = socket.socketpair()
        a.sendall(recording)
        assert _receive(b, integrity.for_link("mac", JOB, 77, 1, 0, "ring 0->1 #0", got1.session), sizes) == messages
        a.close()
        # the replay: injected into connection 2 in place of rank 0's own bytes
        c2.sendall(recording)
        with pytest.raises(IntegrityError, match="MAC does not match"):
            _receive(s2, integrity.for_link("mac", JOB, 77, 1, 0, "ring 0->1 #0", got2.session), sizes)
    finally:
        for s in (c1, s1, c2, s2):
            s.close()


def test_a_mac_key_needs_the_connections_nonces():
    with pytest.raises(ValueError, match="nonces"):
        integrity.for_link("mac", JOB, 9, 0, 1, "p2p 0->1", b"")
