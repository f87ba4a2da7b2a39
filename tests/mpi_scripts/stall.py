"""Run under mpirun -n 2: rank 0 waits for rank 1, which never comes. Nothing may hang.

argv[1] = "sleep": rank 1 stays alive but never joins rank 0's all_sum, so rank 0's per-op
deadline (argv[2] seconds) must abort the job. "die": rank 1 exits with status 3 while rank 0
is in all_sum, so the MPI runtime must stop rank 0. "noinit": rank 1 never initializes MPI, so
rank 0's MPI_Init must give up after JACKLRING_CONNECT_TIMEOUT. In every case mpirun has to
return non-zero long before rank 1's sleep would end.
"""
from __future__ import annotations

import os
import sys
import time

mode, timeout = sys.argv[1], float(sys.argv[2])
if mode == "noinit" and os.environ.get("OMPI_COMM_WORLD_RANK") == "1":
    time.sleep(120)
    sys.exit(0)

import numpy as np  # noqa: E402

import adapter  # noqa: E402

group = adapter.init(backend="mpi", strict=True, timeout=timeout)
if mode == "noinit":
    print("rank 0: init returned although rank 1 never initialized MPI", flush=True)
    sys.exit(0)
adapter.barrier()
if group.rank() == 0:
    adapter.all_sum(np.ones(4, np.float32))
    print("rank 0: all_sum returned although rank 1 never joined", flush=True)
    sys.exit(0)
if mode == "die":
    time.sleep(0.5)
    os._exit(3)
time.sleep(120)
