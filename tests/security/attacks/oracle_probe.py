"""Probe a rank's listener for anything keyed by the job secret, with the public token (the
context of the first ring a process forms), as version 2 and as version 3 of the handshake,
the latter with a made-up proof. argv: address addresses.json-text sender receiver.
Prints one line per probe: PROBE <version> <hex of every byte the listener sent back>."""
import json
import os
import sys

from common import NEW_HELLO, connect, public_token, recv_n, ring_context_v2, v2_hello

address, addresses, sender, receiver = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
PURPOSE_P2P = 2
token = public_token(ring_context_v2(addresses, 1))

s = connect(address)
s.sendall(v2_hello(PURPOSE_P2P, sender, receiver, 0, token))
print("PROBE 2", recv_n(s, 69).hex() or "-", flush=True)
s.close()

s = connect(address)
s.sendall(NEW_HELLO.pack(b"JKLR", 3, PURPOSE_P2P, sender, receiver, 0, token, os.urandom(32)))
got = recv_n(s, 37)
if len(got) == 37 and got[4] == 0:
    s.sendall(os.urandom(32))  # a guess at the proof
    got += recv_n(s, 37)
print("PROBE 3", got.hex() or "-", flush=True)
s.close()
