"""One rank of test_over_backends.py's failure tests: `dead_peer_worker.py BACKEND OUT.json [absent]`.
The last rank leaves after a barrier (with `absent`: rank n - 2 stays but never calls the
collective); the others run a forced recursive-doubling all_sum and write which error they got
and how long it took."""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import adapter

backend, out_path = sys.argv[1], sys.argv[2]
absent = sys.argv[3:] == ["absent"]
g = adapter.init(strict=True, backend=backend)
rank, n = g.rank(), g.size()
adapter.barrier(group=g)
if absent and rank == n - 2:
    time.sleep(8)  # alive, but never in the collective, until every survivor has raised (deadline 3 s)
    os._exit(0)
if rank == n - 1 and not absent:
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
