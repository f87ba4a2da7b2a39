"""Open connections to a rank's listener one after another for `seconds`, each with a HELLO
carrying the public token and, when challenged, a made-up proof: every answered proof is a
MAC check the acceptor did. argv: address addresses.json-text seconds.
Prints: CHECKED <proofs answered> CLOSED <connections closed unanswered> SECONDS <elapsed>."""
import json
import os
import socket
import sys
import time

from common import NEW_HELLO, public_token, recv_n, ring_context_v2

address, addresses, seconds = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
host, _, port = address.rpartition(":")
token = public_token(ring_context_v2(addresses, 1))
checked = closed = 0
t0 = time.monotonic()
while time.monotonic() - t0 < seconds:
    try:
        s = socket.create_connection((host, int(port)), timeout=2)
    except OSError:
        continue
    try:
        s.sendall(NEW_HELLO.pack(b"JKLR", 3, 2, 1, 0, 0, token, os.urandom(32)))
        challenge = recv_n(s, 37)
        if len(challenge) == 37 and challenge[4] == 0:
            s.sendall(os.urandom(32))
            if len(recv_n(s, 37)) == 37:
                checked += 1
                continue
        closed += 1
    except OSError:
        closed += 1
    finally:
        s.close()
print("CHECKED", checked, "CLOSED", closed, "SECONDS", round(time.monotonic() - t0, 2), flush=True)
