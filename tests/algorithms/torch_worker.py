"""One rank of test_over_backends.py's torch test: `torch_worker.py RANK WORLD PORT OUT.json`.
dist.all_reduce through the jacklring process group, whose ring chooses the schedule as the
ring backend does (selection.py); writes the result's bits."""
from __future__ import annotations

import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from alg_values import contribution  # noqa: E402

import adapter.torch_backend  # noqa: E402

rank, world, port, out_path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
adapter.torch_backend.register_backend()
dist.init_process_group("jacklring", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))
t = torch.from_numpy(contribution(rank, 64).copy())
dist.all_reduce(t)
with open(out_path, "w") as f:
    json.dump({"sum": t.numpy().tobytes().hex()}, f)
dist.destroy_process_group()
