"""An outsider who read a store ring's records during one run writes them back during the next
(torch's TCPStore has no authentication; with torchrun's default run id or plain env:// the key
names repeat from run to run). It reads the records at the given keys, listens on the ports
they name (their ranks have exited), and, every `pause` seconds for SECONDS, writes the old
records back. Whoever dials a listener of its answers with a challenge and counts the proofs
it receives (what it would test guesses of a passphrase against).

    store_replay.py STORE_PORT SECONDS PAUSE KEY [KEY ...]

A KEY written -KEY is deleted every round instead (e.g. the ranks' seals).

Prints READY <n records>, a line PROOF <port> per proof received, then DONE <writes> <proofs>."""
import json
import os
import socket
import struct
import sys
import threading
import time

VALIDATE, SET, COMPARE_SET, DELETE_KEY = 0, 1, 2, 8     # TCPStore's query types
VALIDATION_MAGIC = 0x3C85F7CE
ABSENT = b"\0outsider-absent"
HELLO_BYTES, PROOF_BYTES = 60, 32        # handshake.HELLO's size, a MAC


def string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("closed")
        data += chunk
    return data


def read(sock: socket.socket, key: bytes) -> bytes | None:
    sock.sendall(bytes([COMPARE_SET]) + string(key) + string(ABSENT) + string(ABSENT))
    size = struct.unpack("<Q", recv_exact(sock, 8))[0]
    value = recv_exact(sock, size)
    return None if value == ABSENT else value


proofs = 0
lock = threading.Lock()


def answer(listener: socket.socket, port: int) -> None:
    global proofs
    while True:
        conn, _ = listener.accept()
        try:
            conn.settimeout(5)
            recv_exact(conn, HELLO_BYTES)
            conn.sendall(b"JKLC" + b"\0" + os.urandom(32))
            recv_exact(conn, PROOF_BYTES)
            with lock:
                proofs += 1
            print("PROOF", port, flush=True)
        except (OSError, EOFError):
            pass
        conn.close()


def main() -> None:
    port, seconds, pause = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    keys = [k.encode() for k in sys.argv[4:] if not k.startswith("-")]
    doomed = [k[1:].encode() for k in sys.argv[4:] if k.startswith("-")]
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(struct.pack("<BI", VALIDATE, VALIDATION_MAGIC))
    old = {key: read(sock, key) for key in keys}
    old = {k: v for k, v in old.items() if v is not None}
    for value in old.values():
        body = json.loads(value.split(b" ", 2)[2])
        if "address" not in body:
            continue  # another kind of record (an NCCL id): nothing to listen on
        listen_port = int(body["address"].rsplit(":", 1)[1])
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("127.0.0.1", listen_port))
        except OSError:
            continue
        listener.listen(64)
        threading.Thread(target=answer, args=(listener, listen_port), daemon=True).start()
    print("READY", len(old), flush=True)
    writes = 0
    until = time.monotonic() + seconds
    try:
        while time.monotonic() < until:
            for key, value in old.items():
                sock.sendall(bytes([SET]) + string(key) + string(value))
                writes += 1
            for key in doomed:
                sock.sendall(bytes([DELETE_KEY]) + string(key))
                recv_exact(sock, 8)  # how many keys it deleted
            time.sleep(pause)
    except (OSError, EOFError):
        pass  # the store went away
    print("DONE", writes, proofs, flush=True)


if __name__ == "__main__":
    main()
