"""Alternate lines on stdout and stderr, each flushed at once: `out 0`, `err 0`, `out 1`, ..."""
import sys

for i in range(int(sys.argv[1])):
    print(f"out {i}", flush=True)
    print(f"err {i}", file=sys.stderr, flush=True)
