"""One rank of test_over_backends.py's staged test: `staged_worker.py BACKEND OUT.json`. Ranks 0
and 1 share a host, the others are each alone: the group runs in stages and its leaders run the
schedule JACKLRING_ALGORITHM forces among the hosts."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from alg_values import contribution  # noqa: E402

import adapter  # noqa: E402

backend, out_path = sys.argv[1], sys.argv[2]
g = adapter.init(strict=True, backend=backend)
found = {"staged": g.backend.staging is not None,
         "sum": adapter.all_sum(contribution(g.rank(), 64), group=g).tobytes().hex()}
g.close()
with open(out_path, "w") as f:
    json.dump(found, f)
