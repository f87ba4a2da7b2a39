"""A rank that records the secret and token it was given, then waits (up to 30 s) until the
test has looked at every command line on the machine."""
import os
import time

rank = os.environ.get("RANK", os.environ.get("MLX_RANK", "x"))
hold = os.environ["HOLD_DIR"]
with open(os.path.join(hold, f"rank{rank}.tmp"), "w") as f:
    f.write(os.environ.get("JACKLRING_SECRET", "") + "\n" + os.environ.get("API_TOKEN", ""))
os.rename(os.path.join(hold, f"rank{rank}.tmp"), os.path.join(hold, f"rank{rank}.txt"))
go = os.path.join(hold, "go")
until = time.monotonic() + 30
while not os.path.exists(go) and time.monotonic() < until:
    time.sleep(0.05)
