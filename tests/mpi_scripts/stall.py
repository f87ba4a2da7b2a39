"""Run under mpirun -n 2: rank 0 enters all_sum while rank 1 never joins.

argv[1] = "sleep": rank 1 stays alive but idle, so rank 0's per-op deadline (argv[2] seconds)
must abort the job. argv[1] = "die": rank 1 exits with status 3, so the MPI runtime must
stop rank 0. Either way mpirun has to return non-zero long before rank 1's sleep would end.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import adapter

mode, timeout = sys.argv[1], float(sys.argv[2])
group = adapter.init(backend="mpi", strict=True, timeout=timeout)
adapter.barrier()
if group.rank() == 0:
    adapter.all_sum(np.ones(4, np.float32))
    print("rank 0: all_sum returned although rank 1 never joined", flush=True)
    sys.exit(0)
if mode == "die":
    time.sleep(0.5)
    os._exit(3)
time.sleep(120)
