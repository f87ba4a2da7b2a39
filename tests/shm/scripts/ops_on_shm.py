"""Check which transport the group chose (EXPECT_SHM=1/staged/0), then run the every-op-and-dtype
script (all_ops.py: a copy of the ring suite's former script, kept here with real processes per
transport). For the ring or JACCL, whichever the environment starts."""
import os
import runpy
import sys

import adapter

HERE = os.path.dirname(os.path.abspath(__file__))
ALL_OPS = os.path.join(HERE, "all_ops.py")  # every op x dtype against numpy references

g = adapter.init(strict=True)
# 1: the whole group shares memory; staged: it spans hosts and runs in stages (local/staged.py);
# 0: sockets only.
staged = getattr(g.backend, "staging", None)
whole = getattr(g.backend, "shared_memory", None)  # JACCL's
if whole is None:
    whole = getattr(getattr(g.backend, "state", None), "shm", None) is not None  # the ring's
used = "1" if whole else "staged" if staged is not None else "0"
if used != os.environ["EXPECT_SHM"]:
    sys.exit(f"rank {g.rank()}: shared memory used: {used}, expected {os.environ['EXPECT_SHM']}")
sys.argv = [ALL_OPS] + sys.argv[1:]
runpy.run_path(ALL_OPS, run_name="__main__")
where = {"1": "shared memory", "0": "sockets"}.get(used)
if staged is not None:
    where = (f"stages, sharing memory with ranks {staged.members}" if staged.local is not None
             else "stages, alone on its host")
print(f"rank {g.rank()}: {g.backend.name} ok on {where}")
