"""Loop all_sums over shared memory until killed; on the error print how it ended and when."""
import os
import sys
import time

import numpy as np

import adapter

g = adapter.init(strict=True)
state = getattr(g.backend, "state", None)
whole = getattr(g.backend, "shared_memory", None) or getattr(state, "shm", None) is not None  # JACCL's, the ring's
if not whole and getattr(g.backend, "staging", None) is None:
    sys.exit(f"rank {g.rank()}: not on shared memory")  # neither for the whole group nor for its host
x = np.ones(int(sys.argv[1]), np.float32)
adapter.all_sum(x)
print("READY", os.getpid(), flush=True)
end = time.monotonic() + 40
try:
    while time.monotonic() < end:
        adapter.all_sum(x)
except adapter.DistributedError as exc:
    print("RAISED", repr(time.time()), type(exc).__name__, exc, flush=True)
    sys.exit(3)
print("NOERR", flush=True)
