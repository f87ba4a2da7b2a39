"""An elastic job that shrinks (`launcher --min-ranks`): every rank sums (its first rank + 1)
each step; rank --victim SIGKILLs itself at step --kill-at. The survivors shrink and finish
--steps steps on the smaller group, each printing `done <first rank> <rank> <size> <sum>`."""
import argparse
import os
import signal

import numpy as np

import adapter

p = argparse.ArgumentParser()
p.add_argument("--victim", type=int, default=1)
p.add_argument("--kill-at", type=int, default=5)
p.add_argument("--steps", type=int, default=20)
args = p.parse_args()

group = adapter.init(strict=True)
first = group.rank()
step, total = 0, 0.0
while step < args.steps:
    if first == args.victim and step == args.kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        total = float(adapter.all_sum(np.array([first + 1.0]), group=group)[0])
    except adapter.DistributedError:
        group = group.shrink(timeout=5)
        continue
    step += 1
print(f"done {first} {group.rank()} {group.size()} {total:g} {group.backend_name}", flush=True)
