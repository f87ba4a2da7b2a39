"""Hold silent connections against every address and its abstract Unix name (re-opening those
the listener drops) for `seconds`. argv: seconds per_address address ..."""
import socket
import sys
import time

seconds, per_address = float(sys.argv[1]), int(sys.argv[2])
addresses = [a for addr in sys.argv[3:] for a in (addr, "\0jacklring-" + addr)]
held = {a: [] for a in addresses}
opened = 0
flooding = False
end = time.monotonic() + seconds
print("READY", flush=True)
while time.monotonic() < end:
    for a in addresses:
        live = []
        for s in held[a]:
            try:
                s.setblocking(False)
                if s.recv(1, socket.MSG_PEEK) == b"":
                    s.close()
                    continue
            except BlockingIOError:
                pass
            except OSError:
                s.close()
                continue
            live.append(s)
        host, _, port = a.rpartition(":")
        while len(live) < per_address:
            try:
                if a.startswith("\0"):
                    s = socket.socket(socket.AF_UNIX)
                    s.settimeout(0.2)
                    s.connect(a)
                    live.append(s)
                else:
                    live.append(socket.create_connection((host, int(port)), timeout=0.2))
                opened += 1
            except OSError:
                break
        held[a] = live
    if not flooding and any(len(v) >= per_address // 2 for v in held.values()):
        flooding = True
        print("FLOODING", flush=True)  # one listener is full of silent connections
    time.sleep(0.02)
print("OPENED", opened, flush=True)
