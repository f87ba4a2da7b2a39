"""One rank of the two-GPU NCCL test (environment contract: MLX_RANK, MLX_WORLD_SIZE,
NCCL_HOST_IP, NCCL_PORT): every op over cupy arrays through the ops layer and the backend."""
import cupy
import numpy as np

import adapter
from adapter import gpu
from adapter.backends.base import ReduceOp

group = adapter.init(backend="any", strict=True)
assert group.backend_name == "nccl", group
rank = group.rank()
comm = group.backend
assert comm.device == rank, comm.device

x = cupy.arange(1000, dtype=cupy.float32) + rank
y = adapter.all_sum(x)
assert isinstance(y, cupy.ndarray) and y.device.id == rank
assert bool((y == 2 * cupy.arange(1000, dtype=cupy.float32) + 1).all())
assert cupy.asnumpy(adapter.all_max(cupy.asarray([rank], dtype=cupy.int16))).tolist() == [1]
g = adapter.all_gather(cupy.full(3, rank, dtype=cupy.uint8))
assert cupy.asnumpy(g).tolist() == [0, 0, 0, 1, 1, 1]
s = adapter.sum_scatter(cupy.ones(8, dtype=cupy.float64))
assert cupy.asnumpy(s).tolist() == [2.0] * 4
b = adapter.broadcast(cupy.full(4, rank + 5, dtype=cupy.int64), root=1)
assert cupy.asnumpy(b).tolist() == [6] * 4
h = np.full(16, rank, dtype=np.float32)
out = np.empty_like(h)
comm.all_reduce(h, out, ReduceOp.SUM)
assert out.tolist() == [1.0] * 16
mine, theirs = cupy.full(5, rank, dtype=cupy.int32), cupy.empty(5, dtype=cupy.int32)
comm.sendrecv(gpu.device_buffer(mine), 1 - rank, gpu.device_buffer(theirs), 1 - rank)
assert cupy.asnumpy(theirs).tolist() == [1 - rank] * 5
if rank == 0:
    comm.send(np.arange(4, dtype=np.float64), 1)
else:
    r = np.empty(4)
    comm.recv(r, 0)
    assert r.tolist() == [0.0, 1.0, 2.0, 3.0]
sub = group.split(rank)  # two groups of one
assert sub.size() == 1
adapter.barrier()
print(f"rank {rank}: nccl OK")
