"""One ring rank for tests/test_logging.py: forms the group, all_sum, then reports how logging
was left. argv[1]: "none" (the program configures nothing) or "info" (root at INFO, as Ray's
workers and many training scripts configure it).

Prints: LOGGING {"root_handlers": n, "jacklring_level": name, "sum": s}
"""
import json
import logging
import sys

import numpy as np

if sys.argv[1] == "info":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:%(name)s:%(message)s")
root_handlers_before = len(logging.getLogger().handlers)

import adapter  # noqa: E402

g = adapter.init(strict=True)
total = float(adapter.all_sum(np.array([float(g.rank())]))[0])
adapter.shutdown()
logging.getLogger("jacklring.test").warning("rank %d: a warning still shows", g.rank())
sys.stdout.write("LOGGING " + json.dumps({
    "root_handlers_added": len(logging.getLogger().handlers) - root_handlers_before,
    "jacklring_level": logging.getLevelName(logging.getLogger("jacklring").level),
    "sum": total}) + "\n")
sys.stdout.flush()
