"""For a launcher whose stdout nobody reads: every rank writes its pid to $PID_DIR/<rank>.pid,
then rank 1 prints 600 lines of 200 bytes one write each (more small chunks than the
launcher's output backlog holds, enough to fill the pipe it writes into), one line to
stderr, writes $PID_DIR/1.done and exits with 3 (unless $NO_FAIL is set: then it sleeps).
The other ranks sleep."""
import os
import sys
import time

rank = int(os.environ["RANK"])
pid_dir = os.environ["PID_DIR"]
with open(os.path.join(pid_dir, f"{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(pid_dir, f"{rank}.tmp"), os.path.join(pid_dir, f"{rank}.pid"))
if rank != 1:
    time.sleep(60)
    sys.exit(0)
for i in range(600):
    os.write(1, b"%04d " % i + b"x" * 194 + b"\n")
    time.sleep(0.0005)  # each line its own chunk in the launcher
os.write(2, b"rank 1 gives up\n")
if os.environ.get("NO_FAIL"):
    time.sleep(60)
open(os.path.join(pid_dir, "1.done"), "w").close()
sys.exit(3)
