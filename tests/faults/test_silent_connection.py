"""A connection that sends nothing holds a listener for HELLO_TIMEOUT_S (1 s), not longer: the
peer that connects right after it is accepted about a second later."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from adapter.backends.transport import tcp


@pytest.mark.timeout(20)
def test_a_silent_connection_holds_the_listener_for_one_second():
    listener = tcp.Listener("127.0.0.1", 0)
    address = listener.getsockname()[:2]
    hello = tcp.Hello(1, 1, 0, 0, 1234)
    silent = socket.create_connection(address)
    started = time.monotonic()

    def real_peer() -> None:
        time.sleep(0.05)  # after the silent one
        tcp.connect(address, hello, time.monotonic() + 10, "rank 1").close()
    peer = threading.Thread(target=real_peer)
    peer.start()
    try:
        sock, got = tcp.accept(listener, time.monotonic() + 10, lambda h: h == hello, "rank 1")
        took = time.monotonic() - started
        sock.close()
    finally:
        peer.join()
        silent.close()
        listener.close()
    print(f"accepted the real peer {took:.2f} s after a silent connection")
    assert got == hello
    assert tcp.HELLO_TIMEOUT_S == 1.0
    assert 0.9 <= took < 2.0, took
