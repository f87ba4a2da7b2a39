"""Many lines (more than a pipe and the launcher's backlog hold), then `sleep` seconds of
silence (argv[2], default 0): a job whose output must keep flowing."""
import sys
import time

for i in range(int(sys.argv[1])):
    print(f"line {i} " + "x" * 100)
sys.stdout.flush()
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0)
