"""One fault, chosen by FAULT, under the launcher (tests/jaccl/test_jaccl_faults_under_the_launcher.py, test_mpi_backend.py).

dtype: rank 0 all_sums float32, the others float64; op: rank 0 all_sum, the others all_gather;
dead: rank 1 exits with code 3 before the collective; raise: rank 2 (the last) dies of an
uncaught exception while the others wait in a barrier; p2p: rank 0 sends 4 floats to the last
rank, which expects 5.
"""
import os
import sys

import numpy as np

import adapter

group = adapter.init(strict=True)
r, last = group.rank(), group.size() - 1
fault = os.environ["FAULT"]
if fault == "dtype":
    adapter.all_sum(np.ones(4, np.float32 if r == 0 else np.float64))
elif fault == "op":
    adapter.all_sum(np.ones(4)) if r == 0 else adapter.all_gather(np.ones(4))
elif fault == "dead":
    if r == 1:
        sys.stdout.flush()
        os._exit(3)
    adapter.all_sum(np.ones(4))
elif fault == "raise":
    if r == last:
        raise RuntimeError("boom on purpose")
    adapter.barrier()
elif fault == "p2p":
    if r == 0:
        adapter.send(np.ones(4, np.float32), last)
    elif r == last:
        adapter.recv((5,), np.float32, 0)
print(f"finished rank {r}", flush=True)
