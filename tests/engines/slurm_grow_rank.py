"""A rank of an srun step whose group loses slot 2 and takes a newcomer back through the step's
store (tests/engines/test_slurm.py). Members: form, sum, wait for slot 2 to leave, shrink, say
where the store is, then grow. Slot 2 of the first step leaves after the first sum. The newcomer
(JACKLRING_JOIN=1, started in a second step with the first step's variables) joins. Everyone in
the grown group sums and prints one JSON line."""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from grow_steps import shrink_after_a_loss

import adapter


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    joining = os.environ.get("JACKLRING_JOIN") == "1"
    group = adapter.init()
    slot = int(os.environ["SLURM_PROCID"])
    if not joining:
        adapter.all_sum(np.ones(4, np.float32))
        if slot == 2:
            sys.stdout.flush()
            os._exit(0)  # leaves without a word: the members find out in their next collective
        group, failed = shrink_after_a_loss(group)
        say(stage="shrunk", slot=slot, rank=group.rank(), size=group.size(), failed=failed,
            step={k: os.environ[k] for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NODELIST",
                                             "SLURM_STEP_NUM_TASKS")})
        started = time.monotonic()
        group = group.grow(timeout=30)
        grew_s = round(time.monotonic() - started, 2)
    else:
        grew_s = None
    slots = adapter.all_gather(np.array([slot], np.int64))
    total = adapter.all_sum(np.full(8, float(slot + 1), np.float32))
    say(stage="grown", slot=slot, rank=group.rank(), size=group.size(), slots=[int(s) for s in slots],
        right=bool(np.all(total == sum(int(s) + 1 for s in slots))), grew_s=grew_s)


if __name__ == "__main__":
    main()
