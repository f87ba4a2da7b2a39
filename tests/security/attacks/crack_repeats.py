"""Test guesses of a passphrase against one connector proof, offline (what a listener squatting
a rank's address receives): each guess is a word repeated 1 to 8 times, joined by a separator,
stretched as jacklring stretches a user-set secret. Standard library only.

    crack_repeats.py SALT_HEX HELLO_HEX NONCE_HEX PROOF_HEX WORD [WORD ...]

Prints CRACKED <passphrase> <guesses>, or NONE <guesses>."""
import hashlib
import hmac
import sys

salt, hello, nonce, proof = (bytes.fromhex(a) for a in sys.argv[1:5])
guesses = 0
for word in sys.argv[5:]:
    for sep in ("-", " "):
        for times in range(1, 9):
            guess = sep.join([word] * times).encode()
            guesses += 1
            key = hashlib.scrypt(guess, salt=b"jacklring-v3 handshake key\0" + salt, n=1 << 14, r=8, p=1,
                                 maxmem=64 << 20, dklen=32)
            if hmac.compare_digest(hmac.new(key, b"C" + hello + nonce, hashlib.sha256).digest(), proof):
                print("CRACKED", guess.decode(), guesses, flush=True)
                sys.exit(0)
print("NONE", guesses, flush=True)
