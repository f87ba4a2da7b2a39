"""The JACKLRING_VERIFY primitives: both CRC-32C libraries give the same values (ranks with
either agree), pieces chain like the whole, and the BLAKE3 MAC rejects any changed byte."""
from __future__ import annotations

import numpy as np
import pytest

from adapter.backends.transport import integrity
from adapter.backends.transport.auth import NONCE_BYTES, Auth


def test_crc_libraries_agree_whole_and_in_pieces():
    crc32c = pytest.importorskip("crc32c")
    rng = np.random.default_rng(7)
    for size in (0, 1, 7, 64, 1000, 4095, 1 << 20, (1 << 20) + 13):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        view = memoryview(data)  # writable memory, as the engine passes it
        want = crc32c.crc32c(view)
        assert integrity.crc(view) == want, size
        cut = size // 3
        assert integrity.crc(view[cut:], integrity.crc(view[:cut])) == want, size
    assert integrity.CRC_NAME == "crc32c"


def test_blake3_mac_rejects_a_changed_byte_and_a_replay():
    job = Auth(b"k" * 32, True)
    session = b"n" * (2 * NONCE_BYTES)
    sender = integrity.for_link("mac", job, 1, 0, 1, "ring 0->1 #0", session)
    receiver = integrity.for_link("mac", job, 1, 1, 0, "ring 0->1 #0", session)
    message = bytearray(np.arange(5000, dtype=np.float32).tobytes())
    first = sender.seal(message)
    assert receiver.check(message, first) is None
    second = sender.seal(message)
    message[1234] ^= 1
    assert "MAC does not match" in receiver.check(message, second)
    message[1234] ^= 1
    assert "MAC does not match" in receiver.check(message, first)  # message 0's tag, replayed
