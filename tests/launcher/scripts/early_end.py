"""Rank 1 ends right after the group forms (how: argv[1] = "exit0" or "kill9"); rank 0 then
waits in a collective and fails with PeerError. The launcher must blame rank 1."""
import os
import signal
import sys
import time

import numpy as np

import adapter

group = adapter.init(strict=True)
adapter.barrier()
if group.rank() == 1:
    if sys.argv[1] == "kill9":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)
time.sleep(0.3)
adapter.all_sum(np.ones(4))  # raises PeerError: rank 1 is gone
