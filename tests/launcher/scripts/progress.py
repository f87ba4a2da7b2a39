"""A tqdm progress bar of 30 steps on stderr (tqdm's default), then one plain line on stdout."""
import os
import sys
import time

from tqdm import tqdm

rank = os.environ.get("RANK", "0")
for _ in tqdm(range(30), desc=f"epoch {rank}", mininterval=0, miniters=1, ncols=60):
    time.sleep(0.01)
print(f"done {rank}", flush=True)
sys.exit(0)
