"""Failure modes raise instead of hanging. argv extra: "kill" (rank 1 dies by SIGKILL in the
middle of a run; rank 0 must raise within seconds) or "timeout" (init timeout of 2 s; rank 1
is late by 5 s; rank 0 must raise after about 2 s). Rank 0 prints RAISED <seconds> <message>."""
from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from common import init

mode = sys.argv[4]
rank, world = init(timeout_s=2.0 if mode == "timeout" else 60.0)
t = torch.ones(1000)
dist.all_reduce(t)  # the group works
assert t[0].item() == world

if rank == 1:
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(5)
    try:
        dist.all_reduce(torch.ones(1_000_000))
    except Exception as exc:  # the peer gave up on the group already
        print(f"rank 1 late collective raised: {str(exc).splitlines()[0]}")
    sys.exit(0)

start = time.monotonic()
try:
    work = dist.all_reduce(torch.ones(1_000_000), async_op=True)
    work.wait()
except Exception as exc:
    elapsed = time.monotonic() - start
    message = str(exc).splitlines()[0]
    assert "rank 0" in message and "allreduce" in message, message
    print(f"RAISED {elapsed:.2f} {type(exc).__name__}: {message}", flush=True)
    try:  # the group stays unusable, and says so at once
        dist.all_reduce(torch.ones(4))
    except Exception as again:
        print(f"then: {str(again).splitlines()[0]}", flush=True)
    else:
        raise AssertionError("a collective after the failure succeeded")
    os._exit(0)  # skip destroy: the peer is gone
raise AssertionError("all_reduce with a dead / late peer did not raise")
