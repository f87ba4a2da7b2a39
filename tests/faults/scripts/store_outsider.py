"""An outsider to a store ring's job (run as another uid): it reaches the torch store (whose port
is open to anyone on the host) but holds no job key (test_grow.ATTACK squats an address it read). Commands, one per stdin line:

    read SLOT        print "RECORD <raw>" once the knock record of SLOT is there (and differs from the last)
    forge SLOT       overwrite SLOT's knock record with one whose MAC it can only guess; prints FORGED
    replay SLOT      write the last record read back at SLOT's key; prints REPLAYED

    store_outsider.py HOST PORT KEY_PREFIX
"""
import datetime
import json
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
    elif command == "forge":
        fields = {"knock": json.dumps({"address": "127.0.0.1:9", "id": "00" * 16}), "rank": int(arg), "size": 3}
        forged = b"jr1 " + b"0" * 64 + b" " + json.dumps(fields, sort_keys=True).encode()
        store.set(key(arg), forged)
        print("FORGED", flush=True)
    elif command == "replay":
        store.set(key(arg), last)
        print("REPLAYED", flush=True)
