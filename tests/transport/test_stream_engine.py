"""The progress engine over real socket pairs: pipelining callbacks, checksums, dead peers."""
import socket
import struct
import time
import zlib

import pytest

from adapter.backends.transport.stream_engine import Engine, Stream
from adapter.errors import CollectiveTimeout, IntegrityError, PeerError

SESSION = bytes(range(64))  # both handshake nonces of a connection (a MAC key depends on them)


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


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["crc", "mac"])
def test_checked_messages_survive_pieces_of_any_size(mode):
    """Small socket buffers split messages and their trailers across many calls on both ends
    (a trailer's bytes arrive apart from its message's), and the sender, in its own engine,
    seals queued messages while it waits; every message still checks, in order."""
    import threading

    from adapter.backends.transport import auth, integrity
    job = auth.auth_from_secret(b"k" * 32)
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sender = Stream(a, 1, "rank 1 (test)", integrity.for_link(mode, job, 1, 0, 1, "ring 0->1 #0", SESSION))
    receiver = Stream(b, 0, "rank 0 (test)", integrity.for_link(mode, job, 1, 1, 0, "ring 0->1 #0", SESSION))
    sizes = [1, 3, 4, 5, 17, 4095, 4096, 4097, 100_000, 2, 65_537]
    payloads = [bytes((i * 7 + j) % 251 for j in range(n)) for i, n in enumerate(sizes)]
    outs = [bytearray(n) for n in sizes]
    done = []
    for i, (p, o) in enumerate(zip(payloads, outs)):
        sender.post_send(memoryview(p))
        receiver.post_recv(memoryview(o), lambda i=i: done.append(i))
    errors = []

    def send() -> None:
        try:
            Engine([sender], 1).run(time.monotonic() + 10, "test")
        except Exception as exc:  # reported by the assertion below
            errors.append(exc)
    thread = threading.Thread(target=send)
    thread.start()
    time.sleep(0.2)  # the sender fills the socket and waits: it seals the rest meanwhile
    assert sender.unsealed == 0 and len(sender.tails) == len(sender.sendq)
    Engine([receiver], 0).run(time.monotonic() + 10, "test")
    thread.join(10)
    assert not errors and done == list(range(len(sizes))), errors
    assert [bytes(o) for o in outs] == payloads


@pytest.mark.parametrize("mode", ["crc", "mac"])
def test_a_flipped_trailer_byte_is_caught(mode):
    from adapter.backends.transport import auth, integrity
    job = auth.auth_from_secret(b"k" * 32)
    a, b = socket.socketpair()
    seal = integrity.for_link(mode, job, 1, 0, 1, "ring 0->1 #0", SESSION)
    receiver = Stream(b, 0, "rank 0 (test)", integrity.for_link(mode, job, 1, 1, 0, "ring 0->1 #0", SESSION))
    payload = b"z" * 5000
    trailer = bytearray(seal.seal(payload))
    trailer[-1] ^= 1
    a.sendall(payload + trailer)
    receiver.post_recv(memoryview(bytearray(5000)))
    with pytest.raises(IntegrityError, match=r"rank 0: test: checksum mismatch on a 5000-byte message from rank 0"):
        Engine([receiver], 0).run(time.monotonic() + 5, "test")


def test_peer_hanging_up_before_the_trailer_is_a_peer_error():
    a, b = socket.socketpair()
    receiver = Stream(b, 3, "rank 3 (test)", verify=True)
    a.sendall(b"x" * 10)  # the whole message, but not its checksum
    a.close()
    receiver.post_recv(memoryview(bytearray(10)))
    with pytest.raises(PeerError, match=r"rank 0: test: rank 3 \(test\) closed the connection \(4 bytes of the current "
                                        r"message's checksum still expected"):
        Engine([receiver], 0).run(time.monotonic() + 5, "test")


# ---- relays: a message received whole and checked, sent on (ring all-gather, chain broadcast) ----

def _relay_chain(mode):
    """rank 0 -> rank 1 -> rank 2 over real socket pairs, each connection with its own keys:
    (rank 0's out, rank 1's in and out, rank 2's in). The caller makes rank 1 forward from its
    receive callbacks, as the ring does."""
    from adapter.backends.transport import auth, integrity
    job = auth.auth_from_secret(b"k" * 32)
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    return (Stream(a, 1, "rank 1 (test)", integrity.for_link(mode, job, 1, 0, 1, "ring 0->1 #0", SESSION)),
            Stream(b, 0, "rank 0 (test)", integrity.for_link(mode, job, 1, 1, 0, "ring 0->1 #0", SESSION)),
            Stream(c, 2, "rank 2 (test)", integrity.for_link(mode, job, 1, 1, 2, "ring 1->2 #0", SESSION)),
            Stream(d, 1, "rank 1 (127.0.0.1:5001)", integrity.for_link(mode, job, 1, 2, 1, "ring 1->2 #0", SESSION)))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["crc", "mac"])
def test_relayed_messages_check_on_every_hop(mode):
    first_out, middle_in, middle_out, last_in = _relay_chain(mode)
    payloads = [bytes((i + j) % 251 for j in range(n)) for i, n in enumerate([1, 4096, 300_000, 7])]
    relayed = [bytearray(len(p)) for p in payloads]
    outs = [bytearray(len(p)) for p in payloads]
    for p, r, o in zip(payloads, relayed, outs):
        view = memoryview(r)
        first_out.post_send(memoryview(p))
        middle_in.post_recv(view, lambda view=view: middle_out.post_forward(view, middle_in))
        last_in.post_recv(memoryview(o))
    Engine([first_out, middle_in, middle_out, last_in], 0).run(time.monotonic() + 10, "test")
    assert [bytes(o) for o in outs] == payloads


@pytest.mark.timeout(30)
def test_a_relay_sends_the_crc_it_received():
    """The forwarded trailer is the CRC-32C of the bytes as they arrived, not recomputed: a byte
    that changes in the relay's memory after its check (after the reduction, say) is caught by
    the next rank, named with the relay as the sender."""
    first_out, middle_in, middle_out, last_in = _relay_chain("crc")
    payload = bytes(range(256)) * 1000
    relayed = bytearray(len(payload))
    view = memoryview(relayed)

    def corrupt_then_forward() -> None:
        view[12345] ^= 0x10
        middle_out.post_forward(view, middle_in)
    first_out.post_send(memoryview(payload))
    middle_in.post_recv(view, corrupt_then_forward)
    last_in.post_recv(memoryview(bytearray(len(payload))))
    with pytest.raises(IntegrityError, match=r"rank 0: test: checksum mismatch on a 256000-byte message from "
                                             r"rank 1 \(127.0.0.1:5001\): crc32c 0x[0-9a-f]{8}, sender's 0x[0-9a-f]{8}"):
        Engine([first_out, middle_in, middle_out, last_in], 0).run(time.monotonic() + 10, "test")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["crc", "mac"])
def test_a_byte_flipped_on_the_second_hop_of_a_relayed_message_is_caught(mode):
    """rank 1 relays a checked message; between rank 1 and rank 2 one byte flips on the wire
    (a tap reads rank 1's bytes and writes them on, changed): rank 2 names rank 1."""
    from adapter.backends.transport import auth, integrity
    job = auth.auth_from_secret(b"k" * 32)
    a, b = socket.socketpair()
    c, tap_in = socket.socketpair()
    tap_out, d = socket.socketpair()
    first_out = Stream(a, 1, "rank 1 (test)", integrity.for_link(mode, job, 1, 0, 1, "ring 0->1 #0", SESSION))
    middle_in = Stream(b, 0, "rank 0 (test)", integrity.for_link(mode, job, 1, 1, 0, "ring 0->1 #0", SESSION))
    middle_out = Stream(c, 2, "rank 2 (test)", integrity.for_link(mode, job, 1, 1, 2, "ring 1->2 #0", SESSION))
    last_in = Stream(d, 1, "rank 1 (127.0.0.1:5001)", integrity.for_link(mode, job, 1, 2, 1, "ring 1->2 #0", SESSION))
    payload = b"q" * 70_000
    view = memoryview(bytearray(len(payload)))
    first_out.post_send(memoryview(payload))
    middle_in.post_recv(view, lambda: middle_out.post_forward(view, middle_in))
    Engine([first_out, middle_in, middle_out], 0).run(time.monotonic() + 10, "test")
    wire = b""
    while len(wire) < len(payload) + middle_out.verify.size:
        wire += tap_in.recv(1 << 20)
    tap_out.sendall(wire[:500] + b"r" + wire[501:])
    last_in.post_recv(memoryview(bytearray(len(payload))))
    with pytest.raises(IntegrityError, match=r"rank 2: test: checksum mismatch on a 70000-byte message from "
                                             r"rank 1 \(127.0.0.1:5001\)"):
        Engine([last_in], 2).run(time.monotonic() + 10, "test")
