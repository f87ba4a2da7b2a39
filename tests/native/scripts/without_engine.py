"""A rank of a same-host job whose native engine cannot be imported: results must still be
right (over sockets), and the engine module says why it is missing."""
import numpy as np

import adapter
from adapter.backends.local import engine

world = adapter.init()
assert engine.why_missing() is not None, "the engine was importable: the test hid nothing"
n = world.size()
for count in (1, 1000, 300_000):
    x = np.arange(count, dtype=np.float64) * (world.rank() + 1)
    got = adapter.all_sum(x)
    assert np.array_equal(got, np.arange(count, dtype=np.float64) * (n * (n + 1) // 2)), count
got = adapter.all_gather(np.full(3, world.rank(), np.int32))
assert np.array_equal(got.reshape(n, 3)[:, 0], np.arange(n)), got
print(f"rank {world.rank()}: ok without the engine", flush=True)
