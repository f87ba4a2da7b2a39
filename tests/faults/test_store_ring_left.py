"""A ring formed through a torch store: a rank that published its record (its listener was
open then) and left before the ring connected is named at once, not after the connect deadline.

Rank 1 runs the store ring's own first half (listen, take the group key, publish its record)
and exits; rank 0, served the store by the test, forms the ring with a 30 s connect deadline.
Its connection to rank 1 is refused: a published peer that refuses has left (store_ring passes
peers_listening), so rank 0 raises naming rank 1 within a few seconds."""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

dist = pytest.importorskip("torch.distributed")

from adapter.bench import free_ports  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONNECT_S = 30
SECRET = "drawn256:" + secrets.token_hex(32)  # both ranks hold the job secret: no key from rank 0

LEAVER = textwrap.dedent("""
    import os, sys
    from datetime import timedelta
    import torch.distributed as dist
    from adapter.backends.transport import tcp
    from adapter.rendezvous import store_records, store_ring
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timeout=timedelta(seconds=30))
    listener = tcp.Listener("127.0.0.1", 0)
    prefix = store_ring.KEY_PREFIX + store_records.formation_tag("/2") + "/"
    job = store_ring.store_auth(store, prefix, 1, 30.0)
    store_records.RecordBook(store, prefix, job, 1, 2).publish(tcp.format_address(listener.getsockname()[:2]))
    print("PUBLISHED", flush=True)
    os._exit(0)  # gone before the ring connects: the listener closes with the process
""")

STAYER = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from adapter.errors import DistributedError
    from adapter.rendezvous.store_ring import store_ring
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, timeout=timedelta(seconds=30))
    store.wait(["jacklring/addr/f0/1"], timedelta(seconds=30))  # the leaver published (this
    # process's first formation of a 2-rank group: tag f0) and is leaving
    time.sleep(0.3)  # and has exited
    t = time.monotonic()
    try:
        store_ring(store, 0, 2, 30.0)
    except DistributedError as exc:
        print("ERROR", type(exc).__name__, getattr(exc, "culprit", None), round(time.monotonic() - t, 2), exc,
              flush=True)
        sys.exit(3)
    print("FORMED", flush=True)
""")


def env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("JACKLRING_", "MLX_", "SLURM_", "TORCHELASTIC_", "OMPI_", "PMI"))}
    clean.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", JACKLRING_CONNECT_TIMEOUT=str(CONNECT_S),
                 JACKLRING_TIMEOUT=str(CONNECT_S), JACKLRING_SECRET=SECRET)
    return clean


@pytest.mark.timeout(120)
def test_a_published_peer_that_left_is_named_before_the_connect_deadline():
    port = free_ports(1)[0]
    stayer = subprocess.Popen([sys.executable, "-c", STAYER, str(port)], env=env(), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # the store's server listens first
    leaver = subprocess.Popen([sys.executable, "-c", LEAVER, str(port)], env=env(), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out1, err1 = leaver.communicate(timeout=60)
        out0, err0 = stayer.communicate(timeout=CONNECT_S + 40)
    finally:
        for proc in (leaver, stayer):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert leaver.returncode == 0 and "PUBLISHED" in out1, (out1, err1)
    assert stayer.returncode == 3, (out0, err0)
    line = next(line for line in out0.splitlines() if line.startswith("ERROR"))
    print(line)
    _, kind, culprit, elapsed, text = line.split(" ", 4)
    assert kind == "PeerError" and culprit == "1", line
    assert "rank 1 died" in text and "published its record listening, then refused connections" in text, line
    # The deadline is 30 s; the left-neighbour probe runs every 0.25 s.
    assert float(elapsed) < 5.0, line
