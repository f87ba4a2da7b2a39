"""Prints, per refused call, the classes a gloo user's `except` clauses would meet: one line
'CASE <name> <backend> <RuntimeError?> <ValueError?> <DistBackendError?>'. argv: backend, port."""
import datetime
import os
import sys

import torch
import torch.distributed as dist

import adapter.torch_backend  # noqa: F401  (registers jacklring)

backend, port = sys.argv[1], sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1")
dist.init_process_group(backend, timeout=datetime.timedelta(seconds=30))
cases = {
    "band-float": lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND),
    "bxor-float-async": lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BXOR, async_op=True).wait(),
    "premul-sum": lambda: dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0)),
}
for name, call in cases.items():
    try:
        call()
        print(f"CASE {name} {backend} accepted", flush=True)
    except Exception as e:
        print(f"CASE {name} {backend} {isinstance(e, RuntimeError)} {isinstance(e, ValueError)} "
              f"{isinstance(e, dist.DistBackendError)}", flush=True)
dist.destroy_process_group()
