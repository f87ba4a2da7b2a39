"""A connection that sends nothing does not hold up a rank's listener: handshakes run side by
side in the listener's acceptor, so the real peer that connects right after a silent one is
taken at once, and the silent one is dropped after HANDSHAKE_TIMEOUT_S (1 s)."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from adapter.backends.transport import auth, tcp
from adapter.backends.transport.handshake import HANDSHAKE_TIMEOUT_S


@pytest.mark.timeout(20)
def test_a_silent_connection_does_not_delay_the_real_peer():
    job = auth.job_auth(b"silent-connection-test", "the test")
    token = auth.context_id(b"silent-connection-test")
    listener = tcp.Listener("127.0.0.1", 0)
    listener.serve(job, token, 0, lambda h: None, "rank 0")
    address = listener.getsockname()[:2]
    hello = tcp.Hello(1, 1, 0, 0, token)
    silent = socket.create_connection(address)
    started = time.monotonic()

    def real_peer() -> None:
        time.sleep(0.05)  # after the silent one
        tcp.connect(address, hello, time.monotonic() + 10, "rank 1", job).close()
    peer = threading.Thread(target=real_peer)
    peer.start()
    try:
        sock, got = listener.take(lambda h: h.sender == 1, time.monotonic() + 10, "rank 1")
        took = time.monotonic() - started
        sock.close()
        silent.settimeout(HANDSHAKE_TIMEOUT_S + 2)
        dropped = silent.recv(1) == b""  # the acceptor gave up on it and closed it
        dropped_after = time.monotonic() - started
    finally:
        peer.join()
        silent.close()
        listener.close()
    print(f"took the real peer {took:.2f} s after a silent connection; the silent one closed after {dropped_after:.2f} s")
    assert (got.sender, got.receiver, got.purpose) == (1, 0, 1)
    assert took < 0.5, took
    assert dropped and HANDSHAKE_TIMEOUT_S * 0.9 <= dropped_after < HANDSHAKE_TIMEOUT_S + 1.5, dropped_after
