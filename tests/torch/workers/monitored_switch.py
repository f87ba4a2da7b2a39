"""2 ranks, started with JACKLRING_TORCH_MONITORED_BARRIER=0: torch's monitored_barrier refuses
the jacklring group as torch does on any backend but gloo (the setting turns our routing off).
Then a group formed with the setting on answers torch's call without the program's help.
Prints "SWITCH ALL OK"."""
from __future__ import annotations

import datetime
import os

import torch.distributed as dist
from common import init

rank, world = init(timeout_s=20.0)
try:
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=5))
    raise AssertionError("JACKLRING_TORCH_MONITORED_BARRIER=0, yet torch's function was routed")
except ValueError as exc:
    assert "only implemented for GLOO" in str(exc), exc
dist.destroy_process_group()

os.environ["JACKLRING_TORCH_MONITORED_BARRIER"] = "1"
rank, world = init(timeout_s=20.0)
dist.monitored_barrier(timeout=datetime.timedelta(seconds=10), wait_all_ranks=True)
print(f"rank {rank}: torch's monitored_barrier answered", flush=True)
dist.destroy_process_group()
print("SWITCH ALL OK", flush=True)
