"""One rank of test_over_backends.py: `schedules_worker.py BACKEND OUT.json`.

Runs every collective under each forced schedule (JACKLRING_ALGORITHM, read when a group is
created: one split per setting) and writes the hex of every result, for the test to compare
across ranks and against the order docs/algorithms.md promises."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from alg_values import contribution  # noqa: E402

import adapter  # noqa: E402

backend, out_path = sys.argv[1], sys.argv[2]
FORCED = {
    "rd": "all_reduce=rd,all_gather=rd,reduce_scatter=rh,broadcast=tree,barrier=dissemination",
    "rh": "all_reduce=rh",
}
world = adapter.init(strict=True, backend=backend)
rank, n = world.rank(), world.size()
found: dict[str, object] = {"backend": world.backend_name}
for name, setting in FORCED.items():
    os.environ["JACKLRING_ALGORITHM"] = setting
    g = world.split(0, rank)
    count = 64 if name == "rd" else 1000
    first = adapter.all_sum(contribution(rank, count), group=g)
    again = adapter.all_sum(contribution(rank, count), group=g)
    found[f"{name}/all_sum"] = first.tobytes().hex()
    found[f"{name}/again"] = again.tobytes().hex()
    if name == "rd":
        found["gather"] = adapter.all_gather(np.arange(3, dtype=np.int32) + 10 * rank, group=g).tolist()
        found["scatter"] = adapter.sum_scatter(np.arange(2 * n, dtype=np.float64) * (rank + 1), group=g).tolist()
        found["bcast"] = adapter.broadcast(np.full(4, float(rank)), root=n - 1, group=g).tolist()
        adapter.barrier(group=g)
    g.close()
world.close()
with open(out_path, "w") as f:
    json.dump(found, f)
