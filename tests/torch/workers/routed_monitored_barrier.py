"""3+ ranks: torch.distributed.monitored_barrier as a library calls it.

torch's function answers on a jacklring group without the program's help (routed when the first
jacklring group formed): all ranks pass when all arrive; with the last rank late beyond the 1 s timeout, rank 0 raises naming
it, and the others (the late one too) raise because rank 0 did not release them. Then the group
still works: another monitored barrier, an all_reduce, point-to-point messages, a last barrier.
Prints "ROUTED OK".
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist
from common import init

import adapter.torch_backend

rank, world = init(timeout_s=20.0)
late = world - 1
# No call of ours first: the first jacklring group routed torch's function on its own
# (JACKLRING_TORCH_MONITORED_BARRIER, default on; tests/torch/test_monitored_barrier_switch.py
# checks that 0 leaves torch's refusal).
dist.monitored_barrier(timeout=datetime.timedelta(seconds=5))  # everyone arrives
adapter.torch_backend.route_monitored_barrier()  # idempotent: an explicit call changes nothing

timeout = datetime.timedelta(seconds=1)
if rank == late:
    time.sleep(2.5)  # arrives beyond rank 0's timeout
start = time.monotonic()
try:
    dist.monitored_barrier(timeout=timeout)
    raise AssertionError(f"rank {rank}: monitored_barrier passed with rank {late} late")
except RuntimeError as exc:
    message = str(exc).splitlines()[0]
    print(f"rank {rank} raised after {time.monotonic() - start:.2f} s: {message}", flush=True)
    expected = (f"Rank {late} failed to pass monitoredBarrier" if rank == 0 else
                f"Rank {rank} successfully reached monitoredBarrier, but received errors")
    assert expected in message, (expected, message)
# The failed barrier withdrew its receives and each barrier has its own tag: the group stays
# usable. The late rank is still waiting to be released (1 s past its arrival): the next barrier
# gives it time, and must not be passed or starved by the failed one's late messages.
dist.monitored_barrier(timeout=datetime.timedelta(seconds=8))
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2, t
got = torch.zeros(1)
right, left = (rank + 1) % world, (rank - 1) % world
sent = dist.isend(torch.tensor([float(rank)]), right)
dist.recv(got, left)
sent.wait()
assert got.item() == float(left), (rank, got)
dist.monitored_barrier(timeout=datetime.timedelta(seconds=5))
print(f"rank {rank}: the group works after the failed barrier", flush=True)
dist.destroy_process_group()
print("ROUTED OK", flush=True)
