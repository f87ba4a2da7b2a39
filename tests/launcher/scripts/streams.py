"""One line on stdout, one on stderr, then a partial line without newline."""
import os
import sys

rank = os.environ["RANK"]
print(f"out {rank}", flush=True)
print(f"err {rank}", file=sys.stderr, flush=True)
sys.stdout.write(f"tail {rank}")
sys.stdout.flush()
