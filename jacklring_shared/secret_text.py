"""Which text can be a job secret: the one rule the launcher and every rank apply, so a secret
the launcher hands out is never one the ranks refuse (docs/security.md, "The job secret").

Hex of at least MIN_SECRET_BYTES bytes is taken as random. Anything else is a passphrase: at
least MIN_SECRET_BYTES bytes, and passphrase_bits at least MIN_PASSPHRASE_BITS. A listener
posing as a rank receives a connector's proof and can test guesses against it offline (at
scrypt's cost), so a guessable passphrase is refused.

The launcher's own secrets have a form of their own, DRAWN_PREFIX and 64 hex digits: 256 bits
drawn by `secrets`, which the ranks use without the scrypt stretch (a guess of 256 random bits
is as hopeless at HMAC speed as at scrypt's; docs/security.md, "Why the key is stretched").
Every other secret, hex included, is stretched."""
from __future__ import annotations

import math
import re
import secrets

MIN_SECRET_BYTES = 16      # a user-supplied secret shorter than this is refused
MIN_PASSPHRASE_BITS = 80   # a non-hex secret estimated weaker than this is refused
WORD_BITS = 13             # a run of letters or digits counts at most as one dictionary word (7776 words)
SEPARATOR_BITS = 2         # any other character: a predictable separator, mostly
GENERATE_HINT = "e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`"


DRAWN_PREFIX = "drawn256:"
DRAWN_BYTES = 32


def drawn_secret_text() -> str:
    """A fresh secret in the launcher's form: 256 bits from `secrets`, marked as drawn."""
    return DRAWN_PREFIX + secrets.token_hex(DRAWN_BYTES)


def is_drawn(text: str) -> bool:
    """Whether the text is in the launcher's form (decode_secret checks the digits)."""
    return text.strip().startswith(DRAWN_PREFIX)


class WeakSecretError(ValueError):
    """The text cannot be the job secret; the message names where it came from and what to do."""


def passphrase_bits(text: str, where: str = "the passphrase") -> float:
    """A deliberately low estimate of a passphrase's entropy: the lower of zxcvbn's (a maintained
    estimator that knows dictionaries, names, keyboard walks, l33t and repeats; imported here,
    not at module import, since the launcher imports this module and zxcvbn costs ~0.1 s) and
    _runs_bits below. Without zxcvbn: WeakSecretError. Every process that judges a passphrase
    (the launcher, each rank) must judge it alike, or a launcher could hand out one its ranks
    refuse, or a rank accept one the others refuse; so none judges without the estimator."""
    own = _runs_bits(text)
    try:
        from zxcvbn import zxcvbn
    except ImportError as exc:
        raise WeakSecretError(
            f"{where} is a passphrase, and judging its strength needs the zxcvbn package (a dependency of "
            f"jacklring), which this Python cannot import ({exc}): `pip install zxcvbn`, or use random hex of at "
            f"least {MIN_SECRET_BYTES} bytes ({GENERATE_HINT}), which needs no judging") from None
    guesses = zxcvbn(text, max_length=max(72, len(text)))["guesses"]
    return min(own, math.log2(max(float(guesses), 1.0)))


def _runs_bits(text: str) -> float:
    """Each maximal run of letters or of digits counts its length times log2 of its alphabet,
    but at most WORD_BITS (it may be one dictionary word); every other character counts
    SEPARATOR_BITS; a run seen before (case aside) counts SEPARATOR_BITS too: a repeat adds
    almost nothing for whoever guesses."""
    bits = 0.0
    seen: set[str] = set()
    for run in re.findall(r"[^\W\d_]+|\d+|[\W_]", text):
        if run.isdigit() or run[0].isalpha():
            if run.lower() in seen:
                bits += SEPARATOR_BITS
                continue
            seen.add(run.lower())
        if run.isdigit():
            bits += min(len(run) * math.log2(10), WORD_BITS)
        elif run[0].isalpha():
            alphabet = 52 if (run.lower() != run and run.upper() != run) else 26
            bits += min(len(run) * math.log2(alphabet), WORD_BITS)
        else:
            bits += SEPARATOR_BITS
    return bits


def decode_secret(text: str, where: str) -> bytes:
    """The secret's bytes (hex decoded, else the passphrase's UTF-8), or WeakSecretError."""
    raw = text.strip()
    if not raw:
        raise WeakSecretError(f"{where} is empty")
    if raw.startswith(DRAWN_PREFIX):
        digits = raw[len(DRAWN_PREFIX):]
        try:
            value = bytes.fromhex(digits)
        except ValueError:
            value = b""
        if len(value) != DRAWN_BYTES or len(digits) != 2 * DRAWN_BYTES:
            raise WeakSecretError(f"{where} starts with {DRAWN_PREFIX!r} but is not followed by {2 * DRAWN_BYTES} "
                                  f"hex digits (that form is for secrets the launcher draws; {GENERATE_HINT})")
        return value
    try:
        value, passphrase = bytes.fromhex(raw), False
    except ValueError:
        value, passphrase = raw.encode(), True
    if len(value) < MIN_SECRET_BYTES:
        raise WeakSecretError(f"{where} is too short: a job secret needs at least {MIN_SECRET_BYTES} bytes "
                              f"({GENERATE_HINT})")
    bits = passphrase_bits(raw, where) if passphrase else None
    if bits is not None and bits < MIN_PASSPHRASE_BITS:
        raise WeakSecretError(f"{where} is a weak passphrase (estimated {bits:.0f} bits, at "
                              f"least {MIN_PASSPHRASE_BITS} needed; dictionary words, names and repeats count "
                              f"little): a listener posing as a rank could guess it offline. Use random hex of "
                              f"at least {MIN_SECRET_BYTES} bytes ({GENERATE_HINT})")
    return value
