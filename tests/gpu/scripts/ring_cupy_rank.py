"""One rank of the two-process ring test: both ranks share GPU 0 and pass cupy arrays (and
CUDA tensors when torch has CUDA) to the ops; results must come back on the GPU."""
import sys

import cupy
import numpy as np

import adapter

group = adapter.init(backend="ring", strict=True)
rank, n = group.rank(), group.size()
assert n == 2, n

x = cupy.arange(1 << 20, dtype=cupy.float32) * (rank + 1)
y = adapter.all_sum(x)
assert isinstance(y, cupy.ndarray) and y.device.id == 0, type(y)
assert bool((y == cupy.arange(1 << 20, dtype=cupy.float32) * 3).all())

g = adapter.all_gather(cupy.full((3, 2), rank, dtype=cupy.int16))
assert isinstance(g, cupy.ndarray) and g.shape == (6, 2)
assert np.array_equal(cupy.asnumpy(g)[:, 0], [0, 0, 0, 1, 1, 1])

m = adapter.all_max(cupy.asarray([rank, -rank], dtype=cupy.float64))
assert cupy.asnumpy(m).tolist() == [1.0, 0.0]

s = adapter.sum_scatter(cupy.ones((4, 5), dtype=cupy.float32))
assert isinstance(s, cupy.ndarray) and s.shape == (2, 5) and bool((s == 2).all())

if rank == 0:
    adapter.send(cupy.arange(5, dtype=cupy.int32), 1)
else:
    r = adapter.recv_like(cupy.zeros(5, dtype=cupy.int32), 0)
    assert isinstance(r, cupy.ndarray) and cupy.asnumpy(r).tolist() == [0, 1, 2, 3, 4]

try:
    import torch
    cuda_torch = torch.cuda.is_available()
except ImportError:
    cuda_torch = False
if cuda_torch:
    t = torch.ones(1000, device="cuda:0", dtype=torch.bfloat16) * (rank + 1)
    u = adapter.all_sum(t)
    assert u.device.type == "cuda" and u.dtype == torch.bfloat16 and bool((u == 3).all())

adapter.barrier()
print(f"rank {rank}: ring with cupy buffers OK (torch CUDA tensors: {'yes' if cuda_torch else 'not available'})")
sys.stdout.flush()
