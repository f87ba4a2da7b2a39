"""Point to point with any peer, split, torch tensors, multi-dimensional shapes."""

import numpy as np

import adapter

g = adapter.init(strict=True)
r, n = g.rank(), g.size()

# send/recv around the ring, then to a non-neighbour (direct connection on demand)
adapter.send(np.arange(6, dtype=np.int32).reshape(2, 3) + r, (r + 1) % n)
got = adapter.recv((2, 3), np.int32, (r - 1) % n)
assert np.array_equal(got, np.arange(6, dtype=np.int32).reshape(2, 3) + (r - 1) % n), got
if n % 2 == 0:  # pairs (0,1), (2,3): odd ranks send back to their even partner
    if r % 2 == 0:
        like = adapter.recv_like(np.zeros(4, np.float64), r + 1)
        assert like.dtype == np.float64 and np.all(like == r + 1), like
    else:
        adapter.send(np.full(4, r, np.float64), r - 1)
if n >= 3:
    if r == 0:
        adapter.send(np.arange(300_000, dtype=np.float64), 2)
    if r == 2:
        big = adapter.recv((300_000,), np.float64, 0)
        assert np.array_equal(big, np.arange(300_000, dtype=np.float64))

# split into even and odd ranks, reversed order by key
sub = g.split(r % 2, key=n - r)
members = [q for q in range(n) if q % 2 == r % 2]
assert sub.size() == len(members), (sub.size(), members)
assert sub.rank() == sorted(members, key=lambda q: n - q).index(r), sub.rank()
total = adapter.all_sum(np.array([r], np.int64), group=sub)
assert total[0] == sum(members), (total, members)
gathered = adapter.all_gather(np.array([r]), group=sub)
assert list(gathered) == sorted(members, key=lambda q: n - q), gathered
big = adapter.all_sum(np.ones(200_000, np.float32) * r, group=sub)
assert np.all(big == sum(members))
# the parent group still works after the split
assert adapter.all_sum(np.array([1]))[0] == n

# torch tensors in, torch tensors out (including bfloat16 and non-contiguous)
try:
    import torch
except ImportError:
    torch = None
if torch is not None:
    t = adapter.all_sum(torch.ones(3, 4, dtype=torch.bfloat16) * (r + 1))
    assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.shape == (3, 4)
    assert torch.all(t == sum(range(1, n + 1)))
    nc = (torch.arange(12, dtype=torch.float32).reshape(3, 4) + r).t()
    s = adapter.all_sum(nc)
    assert torch.equal(s, sum(torch.arange(12, dtype=torch.float32).reshape(3, 4) + q for q in range(n)).t())
    ag = adapter.all_gather(torch.full((2, 2), r, dtype=torch.int64))
    assert ag.shape == (2 * n, 2) and ag[::2, 0].tolist() == list(range(n))
    rv = adapter.recv((2,), torch.float32, (r - 1) % n) if r % 2 else None
    if r % 2 == 0 and (r + 1) < n:
        adapter.send(torch.tensor([1.5, 2.5]), r + 1)
    if rv is not None and r - 1 >= 0:
        assert isinstance(rv, torch.Tensor) and rv.tolist() == [1.5, 2.5]
print(f"rank {r}: misc ok")
