"""Bytes this rank sends on its ring links for one all_sum of each size given (float32)."""
import sys

import numpy as np

import adapter

g = adapter.init(strict=True)
b = g.backend
assert b.state.shm is None, "this measures the socket ring"
for nbytes in (int(s) for s in sys.argv[1].split(",")):
    x = np.ones(nbytes // 4, np.float32) * (g.rank() + 1)
    before = sum(link.bytes_out for link in b.right + b.left)
    y = adapter.all_sum(x)
    sent = sum(link.bytes_out for link in b.right + b.left) - before
    assert np.all(y == g.size() * (g.size() + 1) / 2), y[:4]
    print(f"SENT {nbytes} {sent}", flush=True)
