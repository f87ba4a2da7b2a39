"""Plain TCP throughput around a ring, the ceiling for any all-reduce over the same links.

    python benchmarks/tcp_ceiling.py --rank R --hosts A,B[,C...] --port P --seconds S --out FILE

Every rank listens on its host, sends to the next rank and receives from the previous one, at
the same time, for S seconds (what a one-direction ring step asks of every link), then writes
the bytes/s it received to FILE.json. benchmarks/netns_bench.py runs one per namespace.
"""
from __future__ import annotations

import argparse
import json
import socket
import threading
import time

CHUNK = 1 << 20


def send_for(sock: socket.socket, seconds: float) -> None:
    data = bytes(CHUNK)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)


def receive_all(sock: socket.socket) -> tuple[int, float]:
    """Bytes received until the sender closes, and the seconds from the first byte to the last."""
    buf = bytearray(CHUNK)
    total, first, last = 0, None, 0.0
    while True:
        n = sock.recv_into(buf)
        if not n:
            return total, last - (first or last)
        last = time.monotonic()
        first = first or last
        total += n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--hosts", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    hosts = args.hosts.split(",")
    n, rank = len(hosts), args.rank
    listener = socket.create_server((hosts[rank], args.port))
    listener.settimeout(30)
    right = (rank + 1) % n
    deadline = time.monotonic() + 30
    while True:  # the neighbour may not listen yet
        try:
            out = socket.create_connection((hosts[right], args.port), timeout=5)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise SystemExit(f"tcp_ceiling: rank {rank} cannot reach rank {right} at "
                                 f"{hosts[right]}:{args.port}: {exc}") from None
            time.sleep(0.05)
    try:
        inp, _ = listener.accept()
    except TimeoutError:
        raise SystemExit(f"tcp_ceiling: rank {rank}: rank {(rank - 1) % n} never connected") from None
    inp.settimeout(args.seconds + 30)
    out.settimeout(args.seconds + 30)
    sender = threading.Thread(target=send_for, args=(out, args.seconds), daemon=True)
    sender.start()
    total, seconds = receive_all(inp)
    sender.join(30)
    with open(args.out, "w") as f:
        json.dump({"rank": rank, "bytes": total, "seconds": seconds}, f)


if __name__ == "__main__":
    main()
