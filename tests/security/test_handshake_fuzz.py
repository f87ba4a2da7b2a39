"""The handshake against arbitrary bytes, both ways: an acceptor fed anything only rejects (it
never hands over a connection, never raises, never buffers more than a frame), and a connector
answered with anything fails with PeerError or retries, nothing else."""
from __future__ import annotations

import socket
import threading
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapter.backends.transport import auth, handshake, tcp
from adapter.errors import PeerError

KEY = auth.auth_from_secret(b"k" * 32)
TOKEN = 0x1234
VALID = handshake.Hello(1, 1, 0, 0, TOKEN).pack()


@pytest.fixture(scope="module")
def listener():
    lst = tcp.Listener("127.0.0.1", 0)
    lst.serve(KEY, TOKEN, 0, lambda h: None if h.purpose == 1 else "no", "fuzz")
    yield lst
    lst.close()


def _mutations():
    return st.one_of(
        st.binary(max_size=300),
        st.builds(lambda i, b: VALID[:i] + bytes([b]) + VALID[i + 1:],
                  st.integers(0, len(VALID) - 1), st.integers(0, 255)),
        st.builds(lambda tail: VALID + tail, st.binary(max_size=200)),
    )


@pytest.mark.timeout(120)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_mutations())
def test_acceptor_only_rejects_arbitrary_bytes(listener, data):
    tracemalloc.start()
    try:
        s = socket.create_connection(listener.getsockname()[:2], timeout=5)
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)  # no more bytes: the acceptor decides now, not after its timeout
        s.settimeout(2)
        got = b""
        try:
            while len(got) < handshake.CHALLENGE.size + handshake.ACK.size:
                chunk = s.recv(1024)
                if not chunk:
                    break
                got += chunk
        except (socket.timeout, ConnectionResetError):
            pass
        s.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # at most a challenge came back, and then only a refusal: nobody proved the key
    assert len(got) <= handshake.CHALLENGE.size + handshake.ACK.size
    if len(got) > handshake.CHALLENGE.size:
        ack = got[handshake.CHALLENGE.size:]
        assert ack[:4] == handshake.ACK_MAGIC and ack[4] == handshake.BAD_PROOF
        assert ack[5:] == bytes(len(ack) - 5), "a refusal carried a MAC of the key"
    assert peak < 256 * 1024, f"{peak} bytes allocated for {len(data)} bytes of input"
    assert listener.take(lambda h: True, time.monotonic() + 0.01, None) is None
    assert listener._acceptor._thread.is_alive()


@pytest.mark.timeout(120)
@settings(max_examples=100, deadline=None)
@given(answer=st.binary(max_size=200), close=st.booleans())
def test_connector_fails_cleanly_on_arbitrary_answers(answer, close):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def serve():
        conn, _ = server.accept()
        try:
            conn.recv(handshake.HELLO.size)
            conn.sendall(answer)
            if not close:
                time.sleep(0.1)
        except OSError:
            pass
        conn.close()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    sock = socket.create_connection(server.getsockname(), timeout=5)
    handshake.ANSWER_TIMEOUT_S, saved = 0.05, handshake.ANSWER_TIMEOUT_S
    try:
        with pytest.raises((PeerError, handshake.HandshakeRetry)):
            handshake.client_handshake(sock, handshake.Hello(1, 1, 0, 0, TOKEN).fresh(), KEY, "x", "rank 0")
    finally:
        handshake.ANSWER_TIMEOUT_S = saved
        sock.close()
        thread.join(5)
        server.close()
