"""JACCL's framed exchange over the TCP mesh transport, two ranks in one process over a real
socket pair: checksums (JACKLRING_VERIFY), corrupted frames, stall reports, timeouts that name
the operation, and peer errors that name the peer once."""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import numpy as np
import pytest

from adapter.backends.base import ReduceOp
from adapter.backends.elements import dtype_code
from adapter.backends.jaccl.backend import Checks, JacclBackend
from adapter.backends.jaccl.config import MESH
from adapter.backends.jaccl.exchange import HEADER, VERIFY_FLAG
from adapter.backends.protocol import CHECKSUM as CRC
from adapter.backends.protocol import OP_CODES, checksum
from adapter.backends.transport.tcp_mesh import TcpMeshTransport
from adapter.errors import CollectiveTimeout, DistributedError, IntegrityError, MismatchError, PeerError

DEVICES = [[None, ["rdma_en3"]], [["rdma_en2"], None]]
_LEN = struct.Struct("<Q")


def backend(rank: int, sock: socket.socket, verify: bool = False, stall: float | None = None,
            timeout: float = 10.0) -> JacclBackend:
    labels = {1 - rank: f"rank {1 - rank} (test pair)"}
    transport = TcpMeshTransport(rank, 2, {1 - rank: sock}, labels=labels, spin_s=0.0)
    return JacclBackend(transport, DEVICES, MESH, "tcp", "127.0.0.1", 1, timeout, Checks(verify, stall))


def pair(verify: bool = False, verify1: bool | None = None, **kw) -> tuple[JacclBackend, JacclBackend]:
    a, b = socket.socketpair()
    return backend(0, a, verify, **kw), backend(1, b, verify if verify1 is None else verify1, **kw)


def both(fn0, fn1) -> list:
    """Run rank 0's and rank 1's halves at once (threads); returns [result0, result1] or raises."""
    out: list = [None, None]
    errors: list = []

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate((fn0, fn1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return out


def all_sum(b: JacclBackend, x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    b.all_reduce(x, out, ReduceOp.SUM)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", [1, 1000, 600_000])   # one frame, one frame, several 1 MiB frames
def test_checksummed_all_reduce_and_send_recv_are_right(count):
    b0, b1 = pair(verify=True)
    x0 = np.arange(count, dtype=np.float32)
    x1 = np.full(count, 2.0, np.float32)
    r0, r1 = both(lambda: all_sum(b0, x0), lambda: all_sum(b1, x1))
    assert np.array_equal(r0, x0 + x1) and r0.tobytes() == r1.tobytes()
    got = np.empty(count, np.float32)
    both(lambda: b0.send(x0, 1), lambda: b1.recv(got, 0))
    assert np.array_equal(got, x0)
    b0.close()
    b1.close()


def forged_send_frame(payload: bytes, seq: int = 0, verify: bool = True) -> bytes:
    """What rank 0's send(float32 array) to rank 1 puts on the wire (checksummed with verify)."""
    kind = OP_CODES["send"] | (VERIFY_FLAG if verify else 0)
    header = HEADER.pack(kind, 0, dtype_code(np.float32), 0, seq, 0, 1, len(payload))
    body = header + payload + (CRC.pack(checksum(header + payload)) if verify else b"")
    return _LEN.pack(len(body)) + body


@pytest.mark.timeout(30)
def test_corrupted_frame_raises_integrity_error_naming_the_peer():
    a, b = socket.socketpair()
    receiver = backend(1, b, verify=True)
    payload = np.arange(256, dtype=np.float32).tobytes()
    frame = bytearray(forged_send_frame(payload))
    frame[_LEN.size + HEADER.size + 100] ^= 0x01   # one bit flipped in the data, on the wire
    a.sendall(frame)
    with pytest.raises(IntegrityError, match=r"rank 1: checksum mismatch on a \d+-byte message from rank 0 "
                                             r"\(test pair\) during recv\(float32, 1024 bytes, seq 1\)"):
        receiver.recv(np.empty(256, np.float32), 0)
    # the group is unusable afterwards, and says why
    with pytest.raises(DistributedError, match="unusable after an earlier error.*IntegrityError"):
        receiver.recv(np.empty(256, np.float32), 0)
    a.close()
    receiver.close()


@pytest.mark.timeout(30)
def test_intact_forged_frame_passes_the_check():
    """The forged frame above is exactly what a sender makes: only the flipped bit fails it."""
    a, b = socket.socketpair()
    receiver = backend(1, b, verify=True)
    payload = np.arange(256, dtype=np.float32)
    a.sendall(forged_send_frame(payload.tobytes()))
    got = np.empty(256, np.float32)
    receiver.recv(got, 0)
    assert np.array_equal(got, payload)
    a.close()
    receiver.close()


@pytest.mark.timeout(30)
def test_verify_on_one_rank_only_is_a_clear_error():
    b0, b1 = pair(verify=True, verify1=False)
    with pytest.raises(MismatchError, match="JACKLRING_VERIFY"):
        both(lambda: all_sum(b0, np.ones(4, np.float32)), lambda: all_sum(b1, np.ones(4, np.float32)))
    b0.close()
    b1.close()


@pytest.mark.timeout(30)
def test_stall_is_reported_once_then_the_deadline_names_the_operation(caplog):
    b0, b1 = pair(stall=0.2, timeout=0.8)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="jacklring.jaccl"):
        with pytest.raises(CollectiveTimeout) as info:
            b0.all_reduce(np.ones(1024, np.float32), np.empty(1024, np.float32), ReduceOp.SUM)
    elapsed = time.monotonic() - started
    assert 0.7 < elapsed < 5, elapsed
    text = str(info.value)
    assert text.startswith("rank 0: all_reduce(sum, float32, 4096 bytes, seq 1) timed out: waiting for "
                           "1 message(s) from rank 1 (test pair)"), text
    stalls = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert len(stalls) == 1, stalls
    assert "all_reduce(sum, float32, 4096 bytes, seq 1)" in stalls[0] and "from rank 1 (test pair)" in stalls[0]
    b0.close()
    b1.close()


@pytest.mark.timeout(30)
def test_a_late_peer_within_the_deadline_only_logs():
    b0, b1 = pair(stall=0.2, timeout=10)

    def late():
        time.sleep(0.5)
        return all_sum(b1, np.ones(3, np.int32))
    r0, r1 = both(lambda: all_sum(b0, np.ones(3, np.int32)), late)
    assert (r0 == 2).all() and (r1 == 2).all()
    b0.close()
    b1.close()


@pytest.mark.timeout(30)
def test_peer_error_names_the_peer_once():
    a, b = socket.socketpair()
    receiver = backend(1, b)
    a.close()
    with pytest.raises(PeerError) as info:
        receiver.all_reduce(np.ones(4, np.float32), np.empty(4, np.float32), ReduceOp.SUM)
    text = str(info.value)
    assert text.startswith("rank 1: all_reduce(sum, float32, 16 bytes, seq 1): ") and "rank 0 (test pair)" in text
    assert text.count("rank 0 (test pair)") == 1, text
    receiver.close()


@pytest.mark.timeout(30)
def test_a_peer_that_closed_is_no_error_until_a_message_from_it_is_awaited():
    """A finished peer closing its end while this rank still works is not a failure by itself."""
    a, b = socket.socketpair()
    receiver = backend(1, b)
    a.sendall(forged_send_frame(np.float32(7).tobytes(), 0, verify=False))
    a.close()
    got = np.empty(1, np.float32)
    receiver.recv(got, 0)            # what it sent before closing still arrives
    assert got[0] == 7
    with pytest.raises(PeerError, match=r"rank 0 \(test pair\) closed the connection"):
        receiver.recv(got, 0)
    receiver.close()


def test_stall_report_setting(monkeypatch):
    from adapter.backends.jaccl.backend import stall_report_seconds
    from adapter.errors import ConfigError
    monkeypatch.delenv("JACKLRING_STALL_REPORT", raising=False)
    assert stall_report_seconds() == 30.0
    for raw, want in (("0", None), ("0.0", None), ("2.5", 2.5)):
        monkeypatch.setenv("JACKLRING_STALL_REPORT", raw)
        assert stall_report_seconds() == want
    for raw in ("abc", "-1", "inf"):
        monkeypatch.setenv("JACKLRING_STALL_REPORT", raw)
        with pytest.raises(ConfigError, match="JACKLRING_STALL_REPORT"):
            stall_report_seconds()


def test_spinning_only_when_every_local_rank_has_a_cpu(monkeypatch):
    from adapter.backends.transport import tcp_mesh as mesh_tcp
    from adapter.errors import ConfigError
    monkeypatch.delenv("JACKLRING_SPIN_US", raising=False)
    cpus = mesh_tcp.available_cpus()
    assert mesh_tcp.spin_seconds(cpus) == pytest.approx(50e-6)
    assert mesh_tcp.spin_seconds(cpus + 1) == 0.0      # oversubscribed: sleep at once
    monkeypatch.setenv("JACKLRING_SPIN_US", "20")
    assert mesh_tcp.spin_seconds(cpus + 1) == pytest.approx(20e-6)   # an explicit value wins
    monkeypatch.setenv("JACKLRING_SPIN_US", "x")
    with pytest.raises(ConfigError, match="JACKLRING_SPIN_US"):
        mesh_tcp.spin_seconds(1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("verify", [False, True])
def test_frames_copied_into_their_slots_are_right(monkeypatch, verify):
    """The path registered memory (RDMA) takes: every frame's data copied into its send slot
    (Transport.post_send_parts' default) instead of sent from the caller's buffer."""
    from adapter.backends.transport import tcp_mesh
    monkeypatch.setattr(tcp_mesh, "_GATHER_MIN_BYTES", 1 << 40)
    b0, b1 = pair(verify=verify)
    count = 700_001   # several frames, the last one partial
    x0 = np.arange(count, dtype=np.float32)
    x1 = np.full(count, 2.0, np.float32)
    r0, r1 = both(lambda: all_sum(b0, x0), lambda: all_sum(b1, x1))
    assert np.array_equal(r0, x0 + x1) and r0.tobytes() == r1.tobytes()
    got = np.empty(count, np.float32)
    both(lambda: b0.send(x0, 1), lambda: b1.recv(got, 0))
    assert np.array_equal(got, x0)
    b0.close()
    b1.close()


def forged_frames(data: bytes, payload: int, total: int | None = None) -> list[bytes]:
    """Rank 0's send of `data` (float32) to rank 1 as the wire carries it, frame by frame."""
    kind = OP_CODES["send"]
    out = []
    for index, start in enumerate(range(0, len(data), payload)):
        body = HEADER.pack(kind, 0, dtype_code(np.float32), 0, 0, index, 1, total or len(data)) + \
            data[start:start + payload]
        out.append(_LEN.pack(len(body)) + body)
    return out


@pytest.mark.timeout(30)
def test_frames_arriving_in_pieces_land_straight_in_the_target():
    """Large frames go from the socket straight into the receiver's array; a frame whose length
    prefix and header arrive split across reads (and later bytes in odd pieces) still lands whole."""
    a, b = socket.socketpair()
    receiver = backend(1, b)
    payload = receiver._link.payload
    data = np.arange((payload + payload // 2) // 4, dtype=np.float32)   # two frames
    wire = b"".join(forged_frames(data.tobytes(), payload))
    cuts = [5, 8 + 10, 8 + HEADER.size + 1, 70_000, payload + 3, payload + 8 + 20, len(wire)]

    def send_in_pieces():
        last = 0
        for cut in cuts:
            a.sendall(wire[last:cut])
            last = cut
            time.sleep(0.02)
    sender = threading.Thread(target=send_in_pieces)
    sender.start()
    got = np.zeros_like(data)
    receiver.recv(got, 0)
    sender.join(10)
    assert np.array_equal(got, data)
    a.close()
    receiver.close()


@pytest.mark.timeout(30)
def test_a_frame_of_another_length_than_the_target_expects_is_a_mismatch():
    """A receive set up to land in the target: a sender whose frame is shorter (another size)
    is reported, not written past or half into the target."""
    a, b = socket.socketpair()
    receiver = backend(1, b)
    payload = receiver._link.payload
    count = (payload + payload // 2) // 4
    sent = np.ones(count - 40_000, np.float32)   # the first frame is full, the second shorter
    wire = b"".join(forged_frames(sent.tobytes(), payload, total=count * 4))
    sender = threading.Thread(target=a.sendall, args=(wire,))
    sender.start()
    with pytest.raises(MismatchError, match="out-of-step message from rank 0.*frame 1 with"):
        receiver.recv(np.empty(count, np.float32), 0)
    sender.join(10)
    a.close()
    receiver.close()
