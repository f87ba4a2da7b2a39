"""The passphrase rule against repeats and dictionary words (issue #44 item 2). A passphrase of
one word repeated seven times scored 103 bits and was accepted; the outsider (uid 65534,
standard library only) who holds one connector proof (a squatter at a rank's address gets one)
finds it offline in a handful of guesses. Now such passphrases are refused, and the message
still says how to get a strong secret."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from security_helpers import outsider_fixture  # noqa: F401  (the `outsider` fixture)

from adapter.backends.transport import auth
from adapter.backends.transport.handshake import Hello
from jacklring_shared.secret_text import WeakSecretError, decode_secret, passphrase_bits

REPEATED = "-".join(["password"] * 7)
ROOT = Path(__file__).resolve().parents[2]


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


# Accepted by the rule's own half (91 bits: seven runs of letters, each a word at most) and
# refused by zxcvbn's (71.5 bits: common words, capitals and digits it knows).
ZXCVBN_ONLY_REFUSES = "Password1Dragon1Monkey1Letmein1Qwerty1Football1"


@pytest.mark.parametrize("weak", [REPEATED, "Password1" * 5, "monkey dragon monkey dragon monkey dragon"])
def test_the_rules_own_half_charges_repeats_too(weak):
    from jacklring_shared import secret_text
    assert secret_text._runs_bits(weak) < 80


def _without_zxcvbn(tmp_path) -> dict[str, str]:
    """An environment whose Pythons cannot import zxcvbn (a module of that name that refuses)."""
    shadow = tmp_path / "shadow"
    shadow.mkdir(exist_ok=True)
    (shadow / "zxcvbn.py").write_text("raise ImportError('hidden by the test')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JACKLRING_")}
    return dict(env, PYTHONPATH=os.pathsep.join([str(shadow), str(ROOT)]), JACKLRING_SECRET=ZXCVBN_ONLY_REFUSES)


@pytest.mark.timeout(60)
def test_a_launcher_without_zxcvbn_refuses_to_judge_a_passphrase(tmp_path):
    """Before, a launcher whose Python lacked zxcvbn judged by the rule's own half alone and
    started ranks with a passphrase that ranks with zxcvbn refuse (and a rank without it
    accepted what its peers refused). Now nothing judges a passphrase without the estimator:
    the launcher stops before any rank starts, naming zxcvbn and how to do without it."""
    with pytest.raises(WeakSecretError, match="weak passphrase"):
        decode_secret(ZXCVBN_ONLY_REFUSES, "JACKLRING_SECRET")  # where zxcvbn is installed
    ran = tmp_path / "ran"
    r = subprocess.run([sys.executable, "-m", "launcher.cli", "-n", "2", "--", sys.executable, "-c",
                        f"open({str(ran)!r} + __import__('os').environ['MLX_RANK'], 'w')"],
                       env=_without_zxcvbn(tmp_path), capture_output=True, text=True, timeout=50)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "zxcvbn" in r.stderr and "secrets.token_hex(32)" in r.stderr, r.stderr
    assert not list(tmp_path.glob("ran*")), "a rank started"
    # a rank's own check says the same; hex needs no estimator
    code = ("from jacklring_shared.secret_text import decode_secret as d, WeakSecretError as W\n"
            f"assert len(d('{'ab' * 16}', 'x')) == 16\n"
            "try:\n    d(__import__('os').environ['JACKLRING_SECRET'], 'JACKLRING_SECRET')\n"
            "except W as e:\n    print('REFUSED', e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=_without_zxcvbn(tmp_path), capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.startswith("REFUSED") and "zxcvbn" in r.stdout, r.stdout + r.stderr
