"""A rank of a torchrun job whose group loses slots one after the other and takes a newcomer
back at each through the agent's store (tests/engines/test_engines.py).

ENGINE_TEST_LEAVERS ("2,0"): the slots that leave, in order. In each round every member sums
once; that round's leaver then exits 0 (torchrun's agent keeps the others running), the rest
meet the loss in their next sum, shrink, say so with their torchrun variables, and grow. A
newcomer (JACKLRING_JOIN=1, started outside torchrun with a leaver's variables) joins in the
round its slot left and goes on from there. After every grow each rank gathers the slots,
sums, and prints one JSON line; every line is one write (the workers share torchrun's stdout)."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
from grow_steps import shrink_after_a_loss

import adapter

# What torchrun sets for a worker besides the test's own environment: a newcomer needs them.
TORCHRUN_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def say(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def torchrun_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k in TORCHRUN_NAMES or k.startswith("TORCHELASTIC_")}


def check(slot: int, group, leaver: int) -> None:
    slots = [int(s) for s in adapter.all_gather(np.array([slot], np.int64))]
    total = adapter.all_sum(np.full(8, float(slot + 1), np.float32))
    say(stage="grown", leaver=leaver, slot=slot, rank=group.rank(), size=group.size(), slots=slots,
        right=bool(np.all(total == sum(s + 1 for s in slots))))


def main() -> None:
    leavers = [int(s) for s in os.environ["ENGINE_TEST_LEAVERS"].split(",")]
    slot = int(os.environ["RANK"])
    group = adapter.init(strict=True)  # under torchrun: a ring formed through the agent's store
    say(stage="started", slot=slot, pid=os.getpid(), env=torchrun_variables())
    start = 0
    if os.environ.get("JACKLRING_JOIN") == "1":
        start = leavers.index(slot) + 1
        check(slot, group, slot)
    for leaver in leavers[start:]:
        adapter.all_sum(np.ones(4, np.float32))
        if slot == leaver:
            os._exit(0)  # leaves without a word, successfully: the members find out in their next sum
        group, failed = shrink_after_a_loss(group)
        say(stage="shrunk", leaver=leaver, slot=slot, rank=group.rank(), size=group.size(), failed=failed)
        group = group.grow(timeout=30)
        check(slot, group, leaver)


if __name__ == "__main__":
    main()
