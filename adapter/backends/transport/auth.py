"""The job secret and the proofs built on it.

Every connection between ranks opens with a challenge-response (see handshake.py): the
connector proves it knows the job key by a HMAC-SHA256 over the acceptor's fresh nonce and
everything that identifies the connection (job context, purpose, sender, receiver, channel),
and only then does the acceptor prove it in turn. Nothing secret crosses the wire, and a
recorded handshake is worthless because the nonces are new every time.

The key is stretched from the job secret when one is configured (JACKLRING_SECRET, or
JACKLRING_SECRET_FILE): scrypt, memory-hard, salted by the job's addresses, once per process and
salt (cached). A listener squatting a rank's address receives a connector's proof over its own
nonce and can test guesses of the secret against it offline; scrypt makes each guess cost
~75 ms and 16 MiB, and a passphrase must be strong enough (jacklring_shared/secret_text.py)
that guessing is hopeless anyway. A secret jacklring drew itself (the launcher's form
"drawn256:...", the derived 0600 file, a store ring's group key) is 256 random bits: its key is
an HMAC of it under the same salt, with no stretch. That costs an attacker nothing: the proof
is a MAC under a 256-bit key, which could always be guessed directly at HMAC speed, so 2**256
HMACs was already the cheapest offline attack on such a secret, and it still is. Without a secret the key is
derived from public facts about the job (its addresses): that still keeps stray connections of other jobs out, but anyone who
can see those facts can join, and JACKLRING_REQUIRE_AUTH=1 refuses to run that way.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass

from jacklring_shared.secret_file import ENV_SECRET_FILE, SecretFileError, read_secret_file
from jacklring_shared.secret_text import WeakSecretError, decode_secret, is_drawn

from ... import config
from ...errors import ConfigError

log = logging.getLogger("jacklring.auth")

SECRET_BYTES = 32          # what the launcher generates: 256 random bits
# scrypt: n=2**14, r=8 takes ~75 ms and 16 MiB here, once per process and salt.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 1 << 14, 8, 1
NONCE_BYTES = 32
MAC_BYTES = 32
ENV_SECRET = "JACKLRING_SECRET"


def generate_secret() -> str:
    """A fresh job secret as text (hex: 256 random bits), for a file or store record whose
    reader knows it was drawn (auth_from_secret(..., drawn=True))."""
    return secrets.token_hex(SECRET_BYTES)


@dataclass(frozen=True)
class Secret:
    """A job secret's bytes, and whether jacklring drew them (256 random bits: not stretched)."""

    value: bytes
    drawn: bool


def _decode(text: str, where: str) -> Secret:
    try:
        return Secret(decode_secret(text, where), is_drawn(text))
    except WeakSecretError as exc:
        raise ConfigError(str(exc)) from None


def _read_secret_file(path: str) -> Secret:
    try:
        text = read_secret_file(path)
    except SecretFileError as exc:
        raise ConfigError(str(exc)) from None
    return _decode(text, f"{ENV_SECRET_FILE}={path!r}")


def configured_secret() -> Secret | None:
    """The configured job secret (JACKLRING_SECRET, else JACKLRING_SECRET_FILE), or None."""
    text = config.get(ENV_SECRET)
    if text:
        return _decode(text, ENV_SECRET)
    path = config.get(ENV_SECRET_FILE)
    if path:
        return _read_secret_file(path)
    return None


def job_secret() -> bytes | None:
    """The configured job secret's bytes (JACKLRING_SECRET, else JACKLRING_SECRET_FILE), or None."""
    secret = configured_secret()
    return None if secret is None else secret.value


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


@functools.lru_cache(maxsize=16)
def _stretched_key(secret: bytes, salt: bytes) -> bytes:
    return hashlib.scrypt(secret, salt=b"jacklring-v3 handshake key\0" + salt, n=SCRYPT_N, r=SCRYPT_R,
                          p=SCRYPT_P, maxmem=64 << 20, dklen=32)


def job_auth(public_context: bytes, what: str = "this job", salt: bytes | None = None) -> Auth:
    """The job's Auth: stretched from the secret when configured (salted by salt, by default
    public_context: pass what stays the same across the job's groups so the stretch runs once),
    else from public_context (the facts every rank of the job shares, e.g. its address list).
    JACKLRING_REQUIRE_AUTH=1 turns the second case into a ConfigError."""
    secret = configured_secret()
    if secret is not None:
        return auth_from_secret(secret.value, public_context if salt is None else salt, drawn=secret.drawn)
    if config.get("JACKLRING_REQUIRE_AUTH"):
        raise ConfigError(f"JACKLRING_REQUIRE_AUTH=1 but no job secret is set for {what}: set "
                          f"{ENV_SECRET} (or {ENV_SECRET_FILE}) to the same value on every rank, or "
                          f"start the job with the launcher, which generates one")
    return Auth(hashlib.sha256(b"jacklring-v2 public key\0" + public_context).digest(), False)


def auth_from_secret(secret: bytes, salt: bytes = b"", drawn: bool = False) -> Auth:
    """An Auth from an explicit shared secret (e.g. one distributed through a trusted store),
    stretched with scrypt (once per process for each secret and salt), unless drawn says
    jacklring drew it: 256 random bits, which an HMAC under the same salt turns into the key
    (no guess of them is cheaper than a guess of the key itself)."""
    if drawn:
        if len(secret) < SECRET_BYTES:
            raise ValueError(f"a drawn secret has {SECRET_BYTES} bytes, not {len(secret)}")
        return Auth(hmac.new(secret, b"jacklring-v3 drawn key\0" + salt, hashlib.sha256).digest(), True)
    return Auth(_stretched_key(secret, salt), True)


def secret_needed_across_hosts() -> bool:
    """Whether a group that spans hosts must be refused here: no job secret is configured and
    JACKLRING_ALLOW_UNAUTHENTICATED=1 (a network and hosts the user trusts) is not set."""
    return not config.get("JACKLRING_ALLOW_UNAUTHENTICATED") and configured_secret() is None


def refuse_unauthenticated_hosts(subject: str, hosts: list[str], key_source: str, group: str) -> None:
    """ConfigError when `subject` shows that a group spans hosts (`hosts`: the others) and no
    job secret is set (nor JACKLRING_ALLOW_UNAUTHENTICATED=1): the group's key would then follow
    from `key_source`, which every user of those hosts can read, so any of them could join the
    `group` or inject data. One wording for every backend; a group of one host forms without."""
    if not hosts or not secret_needed_across_hosts():
        return
    raise ConfigError(
        f"jacklring: {subject} ({', '.join(sorted(hosts)[:4])}) and no job secret is set: the {group}'s key "
        f"would follow from {key_source}, so any user of those hosts could join the {group} or inject data. "
        f"Set the same secret on every rank: {ENV_SECRET}=<e.g. the output of "
        f"`python -c 'import secrets; print(secrets.token_hex(32))'`>, or {ENV_SECRET_FILE}=<a 0600 file "
        f"every host can read> (docs/launching.md); `launcher` draws one for you. On a network you trust, "
        f"JACKLRING_ALLOW_UNAUTHENTICATED=1 forms it without one")


def context_id(public_context: bytes) -> int:
    """64 bits naming the job (and group) in the clear, so a connection from another job is
    told apart from an attacker in error messages; proof of membership is the MAC, not this."""
    return int.from_bytes(hashlib.sha256(b"jacklring-context\0" + public_context).digest()[:8], "little")


def equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)
