"""A tqdm progress bar of 30 steps on stderr (tqdm's default), a plain stdout line printed
while the bar is mid-line, and one more stdout line at the end."""
import os
import sys
import time

from tqdm import tqdm

rank = os.environ.get("RANK", "0")
for step in tqdm(range(30), desc=f"epoch {rank}", mininterval=0, miniters=1, ncols=60):
    time.sleep(0.01)
    if step == 15:
        print(f"halfway {rank}", flush=True)
print(f"done {rank}", flush=True)
sys.exit(0)
