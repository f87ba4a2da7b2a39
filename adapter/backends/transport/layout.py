"""Ranks that disagree on the group's layout, told apart from strangers only under the job secret.

A rank's layout is what it read from its hostfile: its rank, the world size and a digest of the
address list. Ranks with different hostfiles have different job contexts (and, without a secret,
different keys), so their handshakes are refused as "another job" and, left alone, each would
wait for the connect deadline and blame a missing peer. A rank refused that way by the listener
where it expects a peer asks that listener for its layout (ask(), in tcp.py) in a handshake of
its own purpose, PURPOSE_LAYOUT, under a key that does not depend on the layout: the job
secret's, salted by the listener's address (which both views share: that is where they met).
Both ends prove that key before either reveals its layout, and each layout frame is MACed over
the connection's two nonces, so a process without the secret (another user, another job, a
squatter) learns nothing and can never make a rank fail with "the layout differs": its
handshake is refused as any stranger's. Without a configured secret there is no such key (the
job's key is then derived from public facts): no layout is compared and the ranks wait for the
connect deadline as before.

The acceptor thread answers the check (acceptor.Acceptor), whatever the rank's main thread is
doing, and records a differing layout for the forming ring to raise (ring/forming.py).
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

from . import auth

PURPOSE_LAYOUT = 0x4C59  # "LY"
MAGIC = b"JKLY"
FRAME = struct.Struct(f"<4sii32s{auth.MAC_BYTES}s")  # magic, rank, world size, address digest, MAC
BODY = struct.Struct("<ii32s")


@dataclass(frozen=True)
class View:
    """One rank's layout: its rank, the world size, and the digest of its address list."""

    rank: int
    size: int
    digest: bytes

    def differs(self, other: "View") -> bool:
        return self.size != other.size or self.digest != other.digest


@dataclass(frozen=True)
class Check:
    """This rank's view and the job secret that keys the comparison."""

    view: View
    secret: auth.Secret

    def key_at(self, address: str) -> auth.Auth:
        """The key of a layout check at the listener on address (its hostfile spelling)."""
        return auth.auth_from_secret(self.secret.value, b"jacklring-v1 layout check\0" + address.encode(),
                                     drawn=self.secret.drawn)

    def frame(self, key: auth.Auth, role: bytes, session: bytes) -> bytes:
        body = BODY.pack(self.view.rank, self.view.size, self.view.digest)
        return FRAME.pack(MAGIC, self.view.rank, self.view.size, self.view.digest,
                          key.mac(b"jacklring-layout\0", role, session, body))


def read(key: auth.Auth, role: bytes, session: bytes, data: bytes) -> View | None:
    """The peer's view from its frame, or None when it is not one MACed under key for role."""
    if len(data) != FRAME.size:
        return None
    magic, rank, size, digest, mac = FRAME.unpack(data)
    body = BODY.pack(rank, size, digest)
    if magic != MAGIC or not auth.equal(mac, key.mac(b"jacklring-layout\0", role, session, body)):
        return None
    return View(rank, size, digest)


def digest(addresses: list[list[str]]) -> bytes:
    return hashlib.sha256(b"jacklring-layout\0" + json.dumps(addresses).encode()).digest()


def check_for(rank: int, addresses: list[list[str]]) -> Check | None:
    """This rank's Check, or None without a configured job secret (nothing to compare under)."""
    return check_of(rank, len(addresses), addresses)


def check_of(rank: int, size: int, facts: list) -> Check | None:
    """A Check of any backend's layout: its rank, its world size, and the JSON-able facts every
    rank must share (the ring: its address list; JACCL: the coordinator and the device matrix)."""
    secret = auth.configured_secret()
    if secret is None:
        return None
    return Check(View(rank, size, digest(facts)), secret)


def describe(mine: View, theirs: View, listing: str = "hostfile lists other addresses") -> str:
    """The disagreement in words, naming both views (`listing`: what differs when the sizes agree)."""
    if mine.size != theirs.size:
        return (f"rank {theirs.rank} believes the world has {theirs.size} ranks, rank {mine.rank} believes "
                f"{mine.size}")
    return (f"rank {theirs.rank}'s {listing} than rank {mine.rank}'s (both list "
            f"{mine.size} ranks)")
