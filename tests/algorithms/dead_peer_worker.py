"""One rank of test_over_backends.py's dead-peer test: `dead_peer_worker.py BACKEND OUT.json`.
The last rank leaves after a barrier; the others run a forced recursive-doubling all_sum and
write which error they got and how long it took."""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import adapter

backend, out_path = sys.argv[1], sys.argv[2]
g = adapter.init(strict=True, backend=backend)
rank, n = g.rank(), g.size()
adapter.barrier(group=g)
if rank == n - 1:
    os._exit(0)
time.sleep(0.5)
start = time.monotonic()
try:
    adapter.all_sum(np.ones(8, np.float32), group=g)
    found = {"returned": True}
except adapter.DistributedError as exc:
    found = {"raised": type(exc).__name__, "message": str(exc)}
found["seconds"] = time.monotonic() - start
with open(out_path, "w") as f:
    json.dump(found, f)
os._exit(0)
