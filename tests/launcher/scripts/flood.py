"""Rank 0 floods stdout without end; rank 1 exits with code 4 after 0.3 s.

Both write their pid to $PID_DIR/<rank>.pid first. The launcher must stop rank 0 even
when nobody reads the launcher's own stdout."""
import os
import sys
import time

rank = int(os.environ["RANK"])
pid_dir = os.environ["PID_DIR"]
with open(os.path.join(pid_dir, f"{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(pid_dir, f"{rank}.tmp"), os.path.join(pid_dir, f"{rank}.pid"))
if rank == 1:
    time.sleep(0.3)
    sys.exit(4)
chunk = (b"y" * 1023 + b"\n") * 1024
while True:
    sys.stdout.buffer.write(chunk)
