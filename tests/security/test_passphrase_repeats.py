"""The passphrase rule against repeats and dictionary words (issue #44 item 2). A passphrase of
one word repeated seven times scored 103 bits and was accepted; the outsider (uid 65534,
standard library only) who holds one connector proof (a squatter at a rank's address gets one)
finds it offline in a handful of guesses. Now such passphrases are refused, and the message
still says how to get a strong secret."""
from __future__ import annotations

import os

import pytest
from security_helpers import outsider_fixture  # noqa: F401  (the `outsider` fixture)

from adapter.backends.transport import auth
from adapter.backends.transport.handshake import Hello
from jacklring_shared.secret_text import WeakSecretError, decode_secret, passphrase_bits

REPEATED = "-".join(["password"] * 7)


@pytest.mark.timeout(120)
def test_a_repeated_word_is_found_from_one_proof_and_is_refused(outsider):
    salt = b"store-ring 127.0.0.1:29500 run -"
    key = auth.auth_from_secret(REPEATED.encode(), salt)
    hello = Hello(1, 0, 1, 0, 7).fresh().pack()
    nonce = os.urandom(auth.NONCE_BYTES)
    proof = key.mac(b"C", hello, nonce)
    attack = outsider("crack_repeats.py", salt.hex(), hello.hex(), nonce.hex(), proof.hex(), "admin", "password")
    out, err = attack.communicate(timeout=100)
    assert out.startswith(f"CRACKED {REPEATED} "), out + err  # the attack is real: a few dozen guesses
    with pytest.raises(WeakSecretError) as refused:
        decode_secret(REPEATED, "JACKLRING_SECRET")
    assert "secrets.token_hex(32)" in str(refused.value)  # still says how to get a strong one


@pytest.mark.parametrize("weak", [REPEATED, "Password1" * 5, "Password1-Password1-Password1-Password1-Password1",
                                  "correct horse battery staple!", "monkey dragon monkey dragon monkey dragon"])
def test_repeats_and_dictionary_words_are_refused(weak):
    assert passphrase_bits(weak) < 80
    with pytest.raises(WeakSecretError, match="weak passphrase"):
        decode_secret(weak, "JACKLRING_SECRET")


@pytest.mark.parametrize("strong", ["dwarf-plank-oxide-bloom-tundra-vivid-sprout",
                                    "gravel lucid orbit fennel quartz mango tidal"])
def test_seven_random_words_still_pass(strong):
    assert decode_secret(strong, "JACKLRING_SECRET") == strong.encode()


@pytest.mark.parametrize("weak", [REPEATED, "Password1" * 5, "monkey dragon monkey dragon monkey dragon"])
def test_without_zxcvbn_the_fallback_charges_repeats_too(monkeypatch, weak):
    import sys
    monkeypatch.setitem(sys.modules, "zxcvbn", None)  # `from zxcvbn import ...` raises ImportError
    assert passphrase_bits(weak) < 80
