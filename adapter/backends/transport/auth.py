"""The job secret and the proofs built on it.

Every connection between ranks opens with a challenge-response in both directions (see
tcp.Handshake): each side proves it knows the job key by a HMAC-SHA256 over the other side's
fresh nonce and everything that identifies the connection (job context, purpose, sender,
receiver, channel). Nothing secret crosses the wire, and a recorded handshake is worthless
because the nonces are new every time.

The key is the job secret when one is configured (JACKLRING_SECRET, or JACKLRING_SECRET_FILE;
the launcher always provides one). Without it the key is derived from public facts about the
job (its addresses): that still keeps stray connections of other jobs out, but anyone who
can see those facts can join, and JACKLRING_REQUIRE_AUTH=1 refuses to run that way.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from dataclasses import dataclass

from ... import config
from ...errors import ConfigError

log = logging.getLogger("jacklring.auth")

SECRET_BYTES = 32          # what the launcher generates: 256 random bits
MIN_SECRET_BYTES = 16      # a user-supplied secret shorter than this is refused
MAX_SECRET_FILE_BYTES = 4096
NONCE_BYTES = 32
MAC_BYTES = 32
ENV_SECRET = "JACKLRING_SECRET"
ENV_SECRET_FILE = "JACKLRING_SECRET_FILE"


def generate_secret() -> str:
    """A fresh job secret as text (hex), for a launcher to hand to every rank."""
    return secrets.token_hex(SECRET_BYTES)


def _decode(text: str, where: str) -> bytes:
    raw = text.strip()
    if not raw:
        raise ConfigError(f"{where} is empty")
    try:
        value = bytes.fromhex(raw)
    except ValueError:
        value = raw.encode()  # any passphrase works; hex is only the launcher's form
    if len(value) < MIN_SECRET_BYTES:
        raise ConfigError(f"{where} is too short: a job secret needs at least {MIN_SECRET_BYTES} bytes "
                          f"(e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return value


def _read_secret_file(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ConfigError(f"{ENV_SECRET_FILE}={path!r} cannot be opened: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"{ENV_SECRET_FILE}={path!r} is readable by other users "
                              f"(mode {stat.S_IMODE(info.st_mode):04o}); chmod 600 it")
        data = f.read(MAX_SECRET_FILE_BYTES + 1)
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise ConfigError(f"{ENV_SECRET_FILE}={path!r} is larger than {MAX_SECRET_FILE_BYTES} bytes")
    return _decode(data.decode(errors="replace"), f"{ENV_SECRET_FILE}={path!r}")


def job_secret() -> bytes | None:
    """The configured job secret (JACKLRING_SECRET, else JACKLRING_SECRET_FILE), or None."""
    text = config.get(ENV_SECRET)
    if text:
        return _decode(text, ENV_SECRET)
    path = config.get(ENV_SECRET_FILE)
    if path:
        return _read_secret_file(path)
    return None


@dataclass(frozen=True)
class Auth:
    """The key that proves membership of one job, and whether it is secret."""

    key: bytes
    secret: bool   # False: derived from public facts; keeps strays out, not attackers

    def mac(self, *parts: bytes) -> bytes:
        return hmac.new(self.key, b"".join(parts), hashlib.sha256).digest()

    def derive(self, label: bytes) -> "Auth":
        """A key for one purpose (e.g. message MACs), independent of the handshake key."""
        return Auth(self.mac(b"jacklring-derive\0", label), self.secret)


def job_auth(public_context: bytes, what: str = "this job") -> Auth:
    """The job's Auth: from the secret when configured, else from public_context (the
    facts every rank of the job shares, e.g. its address list). JACKLRING_REQUIRE_AUTH=1
    turns the second case into a ConfigError."""
    secret = job_secret()
    if secret is not None:
        return Auth(hmac.new(secret, b"jacklring-v2 handshake key", hashlib.sha256).digest(), True)
    if config.get("JACKLRING_REQUIRE_AUTH"):
        raise ConfigError(f"JACKLRING_REQUIRE_AUTH=1 but no job secret is set for {what}: set "
                          f"{ENV_SECRET} (or {ENV_SECRET_FILE}) to the same value on every rank, or "
                          f"start the job with the launcher, which generates one")
    return Auth(hashlib.sha256(b"jacklring-v2 public key\0" + public_context).digest(), False)


def auth_from_secret(secret: bytes) -> Auth:
    """An Auth from an explicit shared secret (e.g. one distributed through a trusted store)."""
    return Auth(hmac.new(secret, b"jacklring-v2 handshake key", hashlib.sha256).digest(), True)


def context_id(public_context: bytes) -> int:
    """64 bits naming the job (and group) in the clear, so a connection from another job is
    told apart from an attacker in error messages; proof of membership is the MAC, not this."""
    return int.from_bytes(hashlib.sha256(b"jacklring-context\0" + public_context).digest()[:8], "little")


def equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)
