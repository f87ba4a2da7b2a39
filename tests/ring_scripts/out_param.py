"""out= on the numpy API collectives, 2 ranks of a local ring: results written into the
caller's array (and returned), in place with out=x, and the argument errors."""
import numpy as np
import torch

import adapter

g = adapter.init(strict=True)
rank, n = g.rank(), g.size()
base = np.arange(6, dtype=np.float32).reshape(2, 3)
x = base + rank
expected_sum = base * n + n * (n - 1) / 2

out = np.empty_like(x)
assert adapter.all_sum(x, out=out) is out and np.array_equal(out, expected_sum)
assert adapter.all_max(x, out=out) is out and np.array_equal(out, base + n - 1)
assert adapter.all_min(x, out=out) is out and np.array_equal(out, base)
assert adapter.all_reduce(x, "prod", out=out) is out and np.array_equal(out, base * (base + 1))
inplace = x.copy()
assert adapter.all_sum(inplace, out=inplace) is inplace and np.array_equal(inplace, expected_sum)

gathered = np.empty((2 * n, 3), np.float32)
assert adapter.all_gather(x, out=gathered) is gathered
assert np.array_equal(gathered, np.concatenate([base + q for q in range(n)]))

rows = np.arange(4 * n, dtype=np.int64).reshape(2 * n, 2) + rank
block = np.empty((2, 2), np.int64)
assert adapter.sum_scatter(rows, out=block) is block
full = np.arange(4 * n, dtype=np.int64).reshape(2 * n, 2) * n + n * (n - 1) // 2
assert np.array_equal(block, full[2 * rank:2 * rank + 2])
assert adapter.reduce_scatter(rows, "max", out=block) is block
assert np.array_equal(block, np.arange(4 * n, dtype=np.int64).reshape(2 * n, 2)[2 * rank:2 * rank + 2] + n - 1)

b = x.copy()
assert adapter.broadcast(b, root=1, out=b) is b and np.array_equal(b, base + 1)
into = np.zeros_like(x)
assert adapter.broadcast(x, root=0, out=into) is into and np.array_equal(into, base)

# Plain CPU tensors (the fast view) and the ones that take the general path give the same sums.
for tensor in (torch.from_numpy(x.copy()), torch.tensor(float(rank)), torch.arange(5) + rank,
               torch.from_numpy(x.copy()).requires_grad_(), torch.from_numpy(x.copy()).T, torch.ones(3, dtype=torch.bfloat16)):
    got = adapter.all_sum(tensor)
    want = adapter.all_sum(tensor.detach().float().contiguous().numpy())
    assert isinstance(got, torch.Tensor) and got.shape == tensor.shape and got.dtype == tensor.dtype, (got, tensor)
    assert np.allclose(got.float().numpy(), want), (got, want)

t = torch.from_numpy(x.copy())  # a CPU tensor as out=: written in place
assert adapter.all_sum(t, out=t) is t and np.array_equal(t.numpy(), expected_sum)
ints = torch.arange(6, dtype=torch.int64).reshape(2, 3) + rank
assert adapter.all_reduce(ints, "max", out=ints) is ints and torch.equal(ints, torch.arange(6).reshape(2, 3) + n - 1)
flags = torch.tensor([rank == 0, True])
assert adapter.all_reduce(flags, "band", out=flags) is flags and flags.tolist() == [n == 1, True]


def adapter_calls(call) -> int:
    """Python calls made in adapter/ops.py, arrays.py, gpu.py and group.py during call()."""
    import os
    import sys
    here = os.path.dirname(adapter.__file__)
    mine = {os.path.join(here, name) for name in ("ops.py", "arrays.py", "gpu.py", "group.py")}
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_filename in mine:
            count += 1
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return count


# In place on a C-contiguous array or a plain CPU tensor, out= needs none of its checks: the
# short path makes 7 calls here for an array and 9 for a tensor (its view); the checked path
# made 14 and 20.
inplace, t = x.copy(), torch.from_numpy(x.copy())
assert adapter_calls(lambda: adapter.all_sum(inplace, out=inplace)) <= 8
assert adapter_calls(lambda: adapter.all_sum(t, out=t)) <= 10
assert np.array_equal(inplace, expected_sum) and np.array_equal(t.numpy(), expected_sum)
# Into a separate array or plain tensor (tensor parallelism's call): no checks either when every
# one holds: 8 calls for arrays, 10 for tensors here; the checked path made 11 and 13.
src, dst, tsrc, tdst = x.copy(), np.empty_like(x), torch.from_numpy(x.copy()), torch.empty(x.shape)
assert adapter_calls(lambda: adapter.all_sum(src, out=dst)) <= 9
assert adapter_calls(lambda: adapter.all_sum(tsrc, out=tdst)) <= 11
assert np.array_equal(dst, expected_sum) and np.array_equal(tdst.numpy(), expected_sum)


def refused(call, error, words):
    try:
        call()
    except error as exc:
        text = str(exc)
        assert all(w in text for w in words) and f"rank {rank}" in text, text
        return
    raise AssertionError(f"{call} was accepted")


refused(lambda: adapter.all_sum(x, out=np.empty((3, 2), np.float32)), ValueError, ["all_sum", "shape (3, 2)", "(2, 3)"])
refused(lambda: adapter.all_sum(x, out=np.empty((2, 3), np.float64)), ValueError, ["dtype float64", "float32"])
refused(lambda: adapter.all_max(x, out=np.empty((3, 2), np.float32).T), ValueError, ["not C-contiguous"])
ro = np.empty_like(x)
ro.flags.writeable = False
refused(lambda: adapter.all_min(x, out=ro), ValueError, ["read-only"])
refused(lambda: adapter.all_sum(ro, out=ro), ValueError, ["read-only"])
refused(lambda: adapter.all_gather(x, out=np.empty_like(x)), ValueError, ["all_gather", f"({2 * n}, 3)"])
refused(lambda: adapter.sum_scatter(rows, out=rows), ValueError, ["sum_scatter", "shape"])
refused(lambda: adapter.broadcast(x, out=[0.0] * 6), TypeError, ["broadcast", "numpy array or a CPU torch tensor"])
wide = np.zeros(12, np.float32)
refused(lambda: adapter.all_sum(wide[:6], out=wide[3:9]), ValueError, ["overlaps"])
# The group is still in step after the refusals (they raise before any byte moves).
assert np.array_equal(adapter.all_sum(x), expected_sum)
print("OUT OK", flush=True)
adapter.shutdown()
