"""Point-to-point on the jacklring group: any peer, irecv posted before isend on both sides,
batch_isend_irecv, large messages both ways at once, p2p overlapping a collective. Prints ALL OK."""
from __future__ import annotations

import torch
import torch.distributed as dist
from common import init

rank, world = init()
right, left = (rank + 1) % world, (rank - 1) % world

# irecv posted before isend on every rank: would deadlock with a single p2p thread.
got = torch.empty(100_000)
recv = dist.irecv(got, src=left)
send = dist.isend(torch.full((100_000,), float(rank)), dst=right)
recv.wait(); send.wait()
assert torch.equal(got, torch.full((100_000,), float(left))), got[:4]

# Any peer (not just ring neighbours), several messages in order, blocking API.
for peer in range(world):
    if peer == rank:
        continue
    for i in range(3):
        if rank < peer:
            dist.send(torch.tensor([rank, peer, i]), dst=peer)
            t = torch.empty(3, dtype=torch.int64); dist.recv(t, src=peer)
        else:
            t = torch.empty(3, dtype=torch.int64); dist.recv(t, src=peer)
            dist.send(torch.tensor([rank, peer, i]), dst=peer)
        assert t.tolist() == [peer, rank, i], t

# batch_isend_irecv: a ring exchange in both directions, 4 MB each way (bigger than socket buffers).
outs = [torch.empty(1_000_000), torch.empty(1_000_000)]
ops = [dist.P2POp(dist.irecv, outs[0], left), dist.P2POp(dist.irecv, outs[1], right),
       dist.P2POp(dist.isend, torch.full((1_000_000,), rank + 0.5), right),
       dist.P2POp(dist.isend, torch.full((1_000_000,), rank + 0.25), left)]
for req in dist.batch_isend_irecv(ops):
    req.wait()
assert outs[0][0].item() == left + 0.5 and outs[1][-1].item() == right + 0.25, outs

# A collective in flight while p2p progresses (separate threads and sockets).
big = torch.ones(2_000_000)
work = dist.all_reduce(big, async_op=True)
x = torch.empty(10)
r = dist.irecv(x, src=left); s = dist.isend(torch.arange(10.0) + rank, dst=right)
r.wait(); s.wait(); work.wait()
assert torch.equal(x, torch.arange(10.0) + left) and big[0].item() == world

# bfloat16 and a non-contiguous receive buffer.
m = torch.empty(4, 6, dtype=torch.bfloat16).t()
rq = dist.irecv(m, src=left)
dist.send(torch.arange(24, dtype=torch.bfloat16).view(6, 4) + rank, dst=right)
rq.wait()
assert torch.equal(m, torch.arange(24, dtype=torch.bfloat16).view(6, 4) + left), m

# Tags: recvs match by tag, not by arrival order. Rank 0 posts tag 5 then tag 6; rank 1 sends
# tag 6 first and sends tag 5 only after rank 0 acknowledged the tag-6 message (a FIFO of recvs
# would wait for tag 5 forever). Then two messages arrive before any recv is posted.
if rank == 0:
    x, y, ack = torch.zeros(3), torch.zeros(4, dtype=torch.int64), torch.ones(1)
    first = dist.irecv(x, src=1, tag=5)
    second = dist.irecv(y, src=1, tag=6)
    second.wait()
    dist.send(ack, dst=1, tag=9)
    first.wait()
    assert x.tolist() == [5.0] * 3 and y.tolist() == [6] * 4, (x, y)
    early7, early8 = torch.zeros(2), torch.zeros(2)
    import time
    time.sleep(0.3)  # both messages are in by now, unclaimed
    dist.recv(early8, src=1, tag=8)
    dist.recv(early7, src=1, tag=7)
    assert early7.tolist() == [7.0, 7.0] and early8.tolist() == [8.0, 8.0], (early7, early8)
elif rank == 1:
    dist.send(torch.full((4,), 6, dtype=torch.int64), dst=0, tag=6)
    dist.recv(torch.zeros(1), src=0, tag=9)
    dist.send(torch.full((3,), 5.0), dst=0, tag=5)
    dist.send(torch.full((2,), 7.0), dst=0, tag=7)
    dist.send(torch.full((2,), 8.0), dst=0, tag=8)

# Size mismatch is an error naming the peer, not corrupted data.
if rank == 0:
    dist.send(torch.ones(5), dst=1)
elif rank == 1:
    try:
        dist.recv(torch.empty(6), src=0)
    except Exception as exc:
        assert "rank 0" in str(exc) and "rank 1" in str(exc), exc
        print("mismatch raised:", str(exc).splitlines()[0])
    else:
        raise AssertionError("a 5-element message into a 6-element buffer did not raise")

print(f"rank {rank}: p2p ALL OK")
