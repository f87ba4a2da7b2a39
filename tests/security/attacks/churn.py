"""Open and close TCP connections to the given addresses, round robin, at about RATE a second
in all, for SECONDS (a connection flood from this host's address: 127.0.0.1 for every local
user). Nothing is sent.

    churn.py SECONDS RATE ADDRESS [ADDRESS ...]      (ADDRESS: ip:port)

Prints READY, then DONE <connections> <refused>."""
import socket
import sys
import time

seconds, rate = float(sys.argv[1]), float(sys.argv[2])
targets = [(a.rpartition(":")[0], int(a.rpartition(":")[2])) for a in sys.argv[3:]]
print("READY", flush=True)
opened = refused = 0
start = time.monotonic()
while time.monotonic() - start < seconds:
    for target in targets:
        try:
            with socket.create_connection(target, timeout=1):
                opened += 1
        except OSError:
            refused += 1
    behind = start + (opened + refused) / rate - time.monotonic()
    if behind > 0:
        time.sleep(behind)
print("DONE", opened, refused, flush=True)
