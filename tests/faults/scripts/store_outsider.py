"""An outsider to a store ring's job (run as another uid): it reaches the torch store (whose port
is open to anyone on the host) but holds no job key. Commands, one per stdin line:

    read SLOT        print "RECORD <raw>" once the knock record of SLOT is there (and differs from the last)
    squat SECONDS    listen at the address of the last record read, answering handshakes with
                     what it can (no key) for SECONDS; prints LISTENING, then SEEN <connections>
    forge SLOT       overwrite SLOT's knock record with one whose MAC it can only guess; prints FORGED
    replay SLOT      write the last record read back at SLOT's key; prints REPLAYED

    store_outsider.py HOST PORT KEY_PREFIX
"""
import datetime
import json
import os
import socket
import sys
import time

import torch.distributed as dist

host, port, prefix = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = dist.PrefixStore("jacklring/adapter/", dist.TCPStore(host, port, None, False,
                                                             datetime.timedelta(seconds=10)))
ABSENT = b"\0absent"
last = b""
forged = b""


def key(slot: str) -> str:
    return f"{prefix}knock/{slot}"


def squat(seconds: float) -> None:
    body = json.loads(last.split(b" ", 2)[2])
    address = json.loads(body["knock"])["address"]
    h, p = address.rsplit(":", 1)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((h, int(p)))
    s.listen(16)
    s.settimeout(0.1)
    print("LISTENING", address, flush=True)
    end, seen = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        try:
            c, _ = s.accept()
        except socket.timeout:
            continue
        seen += 1
        c.settimeout(0.5)
        try:  # the handshake's frames as far as it can answer them: a challenge, then a guessed MAC
            c.recv(200)
            c.sendall(b"JKLC" + bytes([0]) + os.urandom(32))
            c.recv(200)
            c.sendall(b"JKLA" + bytes([0]) + os.urandom(32))
            c.recv(200)
        except OSError:
            pass
        c.close()
    s.close()
    print("SEEN", seen, flush=True)


for line in sys.stdin:
    command, _, arg = line.strip().partition(" ")
    if command == "read":
        end = time.monotonic() + 20
        while time.monotonic() < end:
            value = bytes(store.compare_set(key(arg), ABSENT, ABSENT))
            if value not in (ABSENT, last, forged) and value.startswith(b"jr1 "):
                last = value
                print("RECORD", value.decode(), flush=True)
                break
            time.sleep(0.02)
        else:
            print("NORECORD", flush=True)
    elif command == "squat":
        squat(float(arg))
    elif command == "forge":
        fields = {"knock": json.dumps({"address": "127.0.0.1:9", "id": "00" * 16}), "rank": int(arg), "size": 3}
        forged = b"jr1 " + b"0" * 64 + b" " + json.dumps(fields, sort_keys=True).encode()
        store.set(key(arg), forged)
        print("FORGED", flush=True)
    elif command == "replay":
        store.set(key(arg), last)
        print("REPLAYED", flush=True)
