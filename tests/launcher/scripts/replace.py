"""A ring (or, with --backend jaccl, JACCL) job that takes a replacement back in
(`launcher --restart-failed`): every rank adds
(hostfile slot + 1) each step and checks the sum; rank --victim SIGKILLs itself at step
--kill-at. The survivors shrink, then grow to take in the replacement the launcher started (its
init() joins them, since the launcher set JACKLRING_JOIN=1), which learns the step from rank 0.
Each rank prints `done <slot> <rank> <size> <steps>` at the end. --die-when-done: the victim
dies after the work instead (nobody will take a replacement in)."""
import argparse
import os
import signal
import time

import numpy as np

import adapter

p = argparse.ArgumentParser()
p.add_argument("--victim", type=int, default=1)
p.add_argument("--kill-at", type=int, default=5)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--backend", default="ring")
# After the work (the last barrier): the victim SIGKILLs itself at once while the others linger
# 1 s ("before"), or the others exit at once and the victim dies 1 s later ("after").
p.add_argument("--die-when-done", choices=["before", "after"])
args = p.parse_args()

started = time.monotonic()
slot = int(os.environ["MLX_RANK"])
joining = os.environ.get("JACKLRING_JOIN") == "1"
group = adapter.init(strict=True, backend=args.backend)


def expected_sum(group) -> float:
    slots = adapter.all_gather(np.array([slot], np.int64), group=group)
    return float(sum(int(s) + 1 for s in slots))


def sync_step(group, step: int) -> int:
    return int(adapter.broadcast(np.array([step], np.int64), 0, group=group)[0])


step = 0
if joining:
    step = sync_step(group, step)
    print(f"joined {slot} as rank {group.rank()} of {group.size()} at step {step}, "
          f"{time.monotonic() - started:.2f} s after its start", flush=True)
want = expected_sum(group)
while step < args.steps:
    if slot == args.victim and step == args.kill_at and not joining:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        y = adapter.all_sum(np.full(1024, float(slot + 1), np.float32), group=group)
        assert np.all(y == want), (y[0], want)
        step += 1
    except (adapter.PeerError, adapter.CollectiveTimeout) as e:
        print(f"step {step}: {type(e).__name__}; shrinking", flush=True)
        group = group.shrink(timeout=5)
        group = group.grow(timeout=30)
        step = sync_step(group, step)
        want = expected_sum(group)
print(f"done {slot} {group.rank()} {group.size()} {step}", flush=True)
adapter.barrier(group=group)
if args.die_when_done is not None and not joining:
    if slot == args.victim:
        time.sleep(1.0 if args.die_when_done == "after" else 0.0)
        os.kill(os.getpid(), signal.SIGKILL)
    elif args.die_when_done == "before":
        time.sleep(1.0)
