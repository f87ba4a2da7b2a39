"""3+ ranks: torch.distributed.monitored_barrier as a library calls it.

Before adapter.torch_backend.route_monitored_barrier(): torch refuses (gloo only). After it: all
ranks pass when all arrive; with the last rank late beyond the 1 s timeout, rank 0 raises naming
it, and the others (the late one too) raise because rank 0 did not release them.
Prints "ROUTED OK".
"""
from __future__ import annotations

import datetime
import time

import torch.distributed as dist
from common import init

import adapter.torch_backend

rank, world = init(timeout_s=20.0)
late = world - 1
try:
    dist.monitored_barrier()
    raise AssertionError("torch's monitored_barrier accepted a jacklring group")
except ValueError as exc:
    assert "only implemented for GLOO" in str(exc), exc

adapter.torch_backend.route_monitored_barrier()
adapter.torch_backend.route_monitored_barrier()  # idempotent
dist.monitored_barrier(timeout=datetime.timedelta(seconds=5))  # everyone arrives

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
# A failed monitored barrier leaves its messages behind (as on gloo, the group is not reused for
# another one here): meet through the store and end.
dist.distributed_c10d._store_based_barrier(rank, dist.distributed_c10d._get_default_store(), "routed", world,
                                           datetime.timedelta(seconds=20))
dist.destroy_process_group()
print("ROUTED OK", flush=True)
