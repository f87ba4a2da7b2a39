"""Check which transport the ring chose (EXPECT_SHM=1/0), then run the every-op-and-dtype script
(all_ops.py: a copy of the ring suite's former script, kept here with real processes per transport)."""
import os
import runpy
import sys

import adapter

HERE = os.path.dirname(os.path.abspath(__file__))
ALL_OPS = os.path.join(HERE, "all_ops.py")  # every op x dtype against numpy references

g = adapter.init(strict=True)
used = getattr(g.backend, "_shm", None) is not None
if used != (os.environ["EXPECT_SHM"] == "1"):
    sys.exit(f"rank {g.rank()}: shared memory used: {used}, expected {os.environ['EXPECT_SHM']}")
sys.argv = [ALL_OPS] + sys.argv[1:]
runpy.run_path(ALL_OPS, run_name="__main__")
print(f"rank {g.rank()}: ok on {'shared memory' if used else 'sockets'}")
