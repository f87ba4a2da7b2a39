"""Message trailers for JACKLRING_VERIFY: a checksum against accidents, or a MAC against attackers.

crc  CRC-32C (the Castagnoli polynomial), through `crc32c-rs` (carry-less-multiply kernels
     chosen for the CPU at run time: about 2.6x the crc32 instruction alone), else the `crc32c`
     package (the crc32 instruction), else zlib's CRC-32. The first two give the same values, so
     ranks with either agree. A relay that rewrites data can recompute it: it finds
     corruption, not tampering.
mac  keyed BLAKE3 (16-byte tags; SIMD, about 7x keyed BLAKE2b) with a key derived from the job key and both handshake
     nonces for one direction of one connection, over a message counter and the bytes: a
     changed, dropped, replayed or reordered message fails the check, and so does one
     recorded from any other connection. Needs the job secret to mean anything (without one the
     key follows from public facts; JACKLRING_REQUIRE_AUTH=1 refuses that).

One Integrity object per connection direction pair (a stream_engine.Stream): seal() for each message sent and
check() for each message received, in stream order.
"""
from __future__ import annotations

import hmac
import struct

from ...errors import ConfigError
from .auth import NONCE_BYTES, Auth

try:
    from crc32c_rs import crc32c as _crc32c
    CRC_NAME = "crc32c"
except ImportError:  # a declared dependency from Python 3.11; the crc32c package computes the same
    try:
        from crc32c import crc32c as _crc32c
        CRC_NAME = "crc32c"
    except ImportError:  # a declared dependency too; keep working without either
        from zlib import crc32 as _crc32c
        CRC_NAME = "crc32"

try:
    from blake3 import blake3 as _blake3
except ImportError:  # a declared dependency; only mac mode needs it
    _blake3 = None

# crc_update(data, value): the C function itself, for the hot paths (no Python frame per call).
crc_update = _crc32c
CRC = struct.Struct("<I")
MAC_BYTES = 16
_COUNTER = struct.Struct("<Q")


def crc(data, start: int = 0) -> int:
    """CRC-32C of data, continuing from `start` (a header and a payload in two calls)."""
    return _crc32c(data, start)


class _RunningCrc:
    """A CRC-32C fed piece by piece, as the bytes of one message land."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = _crc32c(data, self.value)

    def digest(self) -> bytes:
        return CRC.pack(self.value)


class _RunningMac:
    """A message's BLAKE3 tag fed piece by piece, as the bytes land."""

    __slots__ = ("update", "_hasher")

    def __init__(self, hasher) -> None:
        self._hasher = hasher
        self.update = hasher.update

    def digest(self) -> bytes:
        return self._hasher.digest(MAC_BYTES)


class Integrity:
    """Seals outgoing and checks incoming messages of one connection."""

    __slots__ = ("mode", "size", "_send_key", "_recv_key", "_sent", "_received")

    def __init__(self, mode: str, send_key: bytes = b"", recv_key: bytes = b"") -> None:
        self.mode = mode
        self.size = CRC.size if mode == "crc" else MAC_BYTES
        self._send_key, self._recv_key = send_key, recv_key
        self._sent = self._received = 0

    def seal(self, data) -> bytes:
        if self.mode == "crc":
            return CRC.pack(_crc32c(data))
        tag = _blake3(_COUNTER.pack(self._sent), key=self._send_key)
        tag.update(data)
        self._sent += 1
        return tag.digest(MAC_BYTES)

    def skip(self) -> None:
        """A received message that was discarded unread still counts: a MAC's counter stays in
        step with the sender's."""
        if self.mode != "crc":
            self._received += 1

    def checker(self) -> "_RunningCrc | _RunningMac":
        """The running check of the next incoming message: update() it with each piece as it
        lands (while the data is still in cache), then verdict() it against the trailer."""
        if self.mode == "crc":
            return _RunningCrc()
        tag = _RunningMac(_blake3(_COUNTER.pack(self._received), key=self._recv_key))
        self._received += 1
        return tag

    def verdict(self, running: "_RunningCrc | _RunningMac", trailer) -> str | None:
        """None when the trailer matches the message fed to `running` (from checker()); else
        what was wrong, for the error message."""
        if self.mode == "crc":
            return self.verdict_crc(running.value, trailer)
        if hmac.compare_digest(running.digest(), bytes(trailer)):
            return None
        return f"its MAC does not match (message {self._received - 1}: changed, dropped, replayed or forged)"

    @staticmethod
    def verdict_crc(actual: int, trailer) -> str | None:
        """verdict() for a CRC-32C already computed (a plain int): None when it matches."""
        (expected,) = CRC.unpack(trailer)
        return None if actual == expected else f"{CRC_NAME} {actual:#010x}, sender's {expected:#010x}"

    def check(self, data, trailer) -> str | None:
        """None when the trailer matches data (a whole message at once); else what was wrong."""
        running = self.checker()
        running.update(data)
        return self.verdict(running, trailer)


def for_link(mode: "str | bool", job: Auth | None, context: int, me: int, peer: int,
             connection: str, session: bytes) -> Integrity | None:
    """The Integrity of one connection between ranks `me` and `peer`, or None when
    JACKLRING_VERIFY is off. `connection` names the connection the same way on both ends (e.g.
    "ring 3->4 #0": who connected to whom, which one) and `session` is its handshake's two
    nonces (handshake.Hello.session), so each connection and direction has its own MAC key:
    a stream recorded from one connection, even of an earlier run of the same job with the
    same secret and addresses, fails the check on any other."""
    if not mode:
        return None
    if mode != "mac":
        return Integrity("crc")
    if job is None:
        raise ValueError("JACKLRING_VERIFY=mac needs the job key")
    if _blake3 is None:
        raise ConfigError("JACKLRING_VERIFY=mac needs the blake3 package (pip install blake3)")
    if len(session) < 2 * NONCE_BYTES:
        raise ValueError("JACKLRING_VERIFY=mac needs both handshake nonces of the connection")

    def key(sender: int) -> bytes:
        return job.derive(f"verify-mac {context} {connection} from {sender}\0".encode() + session).key
    return Integrity("mac", key(me), key(peer))
