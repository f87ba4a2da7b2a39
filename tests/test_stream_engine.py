"""The progress engine over real socket pairs: pipelining callbacks, checksums, dead peers."""
import socket
import struct
import time
import zlib

import pytest

from adapter.backends.transport.stream_engine import Engine, Stream
from adapter.errors import CollectiveTimeout, IntegrityError, PeerError


def pair(verify=False):
    a, b = socket.socketpair()
    return Stream(a, 1, "rank 1 (test)", verify), Stream(b, 0, "rank 0 (test)", verify)


def test_callbacks_chain_sends_in_order():
    left, right = pair()
    got = []
    out = bytearray(6)
    right.post_recv(memoryview(out)[:3], lambda: got.append(bytes(out[:3])))
    right.post_recv(memoryview(out)[3:], lambda: got.append(bytes(out[3:])))
    left.post_send(memoryview(b"abc"))
    left.post_send(memoryview(b"def"))
    Engine([left, right], 0).run(time.monotonic() + 5, "test")
    assert got == [b"abc", b"def"]


def test_checksums_pass_through_when_intact():
    left, right = pair(verify=True)
    out = bytearray(1 << 20)
    payload = bytes(range(256)) * 4096
    right.post_recv(memoryview(out))
    left.post_send(memoryview(payload))
    Engine([left, right], 0).run(time.monotonic() + 5, "test")
    assert bytes(out) == payload


def test_corrupted_message_raises_integrity_error_naming_the_peer():
    a, b = socket.socketpair()
    receiver = Stream(b, 1, "rank 1 (127.0.0.1:5001)", verify=True)
    payload = b"x" * 1000
    a.sendall(payload[:-1] + b"y" + struct.pack("<I", zlib.crc32(payload)))  # one byte flipped on the wire
    receiver.post_recv(memoryview(bytearray(1000)))
    with pytest.raises(IntegrityError, match=r"checksum mismatch on a 1000-byte message from rank 1 \(127.0.0.1:5001\)"):
        Engine([receiver], 0).run(time.monotonic() + 5, "test")


def test_peer_hanging_up_is_a_peer_error():
    a, b = socket.socketpair()
    receiver = Stream(b, 3, "rank 3 (test)")
    a.sendall(b"abc")
    a.close()
    receiver.post_recv(memoryview(bytearray(10)))
    with pytest.raises(PeerError, match=r"rank 3 \(test\) closed the connection \(7 bytes"):
        Engine([receiver], 0).run(time.monotonic() + 5, "all_reduce(sum, float32, 10 bytes, seq 1)")


def test_deadline_names_what_is_missing():
    left, right = pair()
    right.post_recv(memoryview(bytearray(8)))
    t = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"8 bytes still to receive from rank 0 \(test\)"):
        Engine([left, right], 0).run(time.monotonic() + 0.3, "test")
    assert time.monotonic() - t < 2
