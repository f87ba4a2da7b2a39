"""A configurable rank for launcher tests.

Writes its pid (and its child's, with --child) to $PID_DIR/<rank>.pid, then:
--fail-rank R --code C: rank R exits with C after --delay s; other ranks sleep --sleep s.
--ignore-term: ignore SIGTERM (the launcher must escalate to SIGKILL).
--child: start a `sleep` grandchild first (the launcher must kill the whole tree).
"""
import argparse
import os
import signal
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--code", type=int, default=1)
p.add_argument("--delay", type=float, default=0.0)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--ignore-term", action="store_true")
p.add_argument("--child", action="store_true")
args = p.parse_args()

rank = int(os.environ["RANK"])
pids = [os.getpid()]
if args.child:
    pids.append(subprocess.Popen(["sleep", "120"]).pid)
if args.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
pid_dir = os.environ.get("PID_DIR")
if pid_dir:
    tmp = os.path.join(pid_dir, f"{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(" ".join(map(str, pids)))
    os.rename(tmp, os.path.join(pid_dir, f"{rank}.pid"))  # atomic: readers never see half
print(f"ready {rank}", flush=True)
if rank == args.fail_rank:
    time.sleep(args.delay)
    print(f"failing with {args.code}", file=sys.stderr, flush=True)
    sys.exit(args.code)
time.sleep(args.sleep)
