"""Send a forged point-to-point message to ring rank `receiver` as rank `sender`, with every
token public information yields (old and new protocol). argv: address addresses.json-text
sender receiver dtype-code. Prints one OUTCOME line per attempt."""
import json
import struct
import sys
import time

from common import connect, new_handshake, old_hello, old_ring_token, ring_context, ring_context_v2

address, addresses, sender, receiver = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
PURPOSE_P2P, OP_SEND = 2, 6
payload = struct.pack("<10d", *([666.0] * 10))


def header(dtype_code):
    return struct.pack("<HBBIQq", 0x4A4B, OP_SEND, dtype_code, 0, len(payload), 0)


# old protocol: hello with the token sha256(addresses), then a send of ten float64
s = connect(address)
s.sendall(old_hello(PURPOSE_P2P, sender, receiver, 0, old_ring_token(addresses)))
s.sendall(header(int(sys.argv[5])) + payload)
print("OUTCOME old-protocol sent", flush=True)
old = s  # kept open: the old code reads the forged message from it

# new protocol, with the key public facts give: the address list alone (an earlier version's
# context), then today's context of the first two rings a process forms
held = []
for context in (ring_context(addresses), ring_context_v2(addresses, 1), ring_context_v2(addresses, 2)):
    s = connect(address)
    outcome = new_handshake(s, PURPOSE_P2P, sender, receiver, 0, context)
    print("OUTCOME new-protocol", outcome, flush=True)
    try:
        s.sendall(header(int(sys.argv[5])) + payload)
    except OSError:
        pass
    held.append(s)
time.sleep(3)
