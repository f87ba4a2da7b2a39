"""A rank of an elastic-job test: `--lose R:HOW:DELAY` (repeatable) makes rank R end after
DELAY s, with HOW an exit code or `kill` (SIGKILL to itself); every other rank sleeps --sleep s,
prints `done <rank>` and exits 0."""
import argparse
import os
import signal
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--lose", action="append", default=[])
p.add_argument("--sleep", type=float, default=1.0)
args = p.parse_args()

rank = int(os.environ["RANK"])
print(f"ready {rank}", flush=True)
for spec in args.lose:
    who, how, delay = spec.split(":")
    if int(who) == rank:
        time.sleep(float(delay))
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(int(how))
time.sleep(args.sleep)
print(f"done {rank}", flush=True)
