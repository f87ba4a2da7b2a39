"""Ranks 0 and 1 each send COUNT float32 to the other, then receive (a symmetric exchange),
for a 16 MB message: larger than any socket buffer, so a backend must not block in send
until the peer receives. Prints `exchange ok` on success."""
import numpy as np

import adapter

group = adapter.init(strict=True)
r = group.rank()
count = 4_000_000
if r < 2:
    adapter.send(np.full(count, r, np.float32), 1 - r)
    got = adapter.recv((count,), np.float32, 1 - r)
    assert (got == 1 - r).all()
print(f"exchange ok {r}", flush=True)
