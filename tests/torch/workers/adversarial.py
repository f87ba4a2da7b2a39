"""What a demanding PyTorch user runs, on 4 ranks, each result compared with gloo in the same
processes: subgroups (a subset, a group this rank is not in, new_subgroups, a 2x2 device mesh),
uneven all_to_all, rooted ops at non-zero roots on non-contiguous tensors, the object
collectives, every dtype x reduce op gloo supports, 0-element tensors, tagged isend/irecv,
Work.wait(timeout), and two groups used from two threads at once. Prints ALL OK."""
from __future__ import annotations

import datetime
import threading
import time

import torch
import torch.distributed as dist
from common import init

rank, world = init()
assert world == 4, "this worker is written for 4 ranks"
JL = dist.group.WORLD
GLOO = dist.new_group(backend="gloo")
R = dist.ReduceOp
checks = 0


def data(dtype: torch.dtype, n: int, salt: int = 0, q: int | None = None) -> torch.Tensor:
    """Small values, exact under any summation order; distinct per rank q."""
    q = rank if q is None else q
    g = torch.Generator().manual_seed(1000 * q + 17 * n + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_complex:
        return torch.complex(torch.randint(-3, 4, (n,), generator=g).float(),
                             torch.randint(-3, 4, (n,), generator=g).float()).to(dtype)
    hi = 3 if dtype in (torch.float16, torch.bfloat16, torch.uint8, torch.int8) else 50
    lo = 1 if dtype == torch.uint8 else -hi
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def check(what: str, got, want) -> None:
    global checks
    got = list(got) if isinstance(got, (list, tuple)) else [got]
    want = list(want) if isinstance(want, (list, tuple)) else [want]
    assert len(got) == len(want), f"rank {rank}: {what}: {len(got)} results, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"rank {rank}: {what}[{i}]: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"rank {rank}: {what}[{i}]: jacklring {a.flatten()[:8]} != gloo {b.flatten()[:8]}"
    checks += 1


def outcome(fn, group):
    """fn(group)'s result, or the exception type when it raises."""
    try:
        return fn(group)
    except (RuntimeError, ValueError, TypeError) as exc:
        return exc


def both(what: str, fn, jl=None, gloo=None) -> None:
    """fn(group) on jacklring and on gloo with the same inputs; results must be equal. When gloo
    refuses the call, jacklring must refuse it too (or give gloo's answer computed another way)."""
    ours, theirs = outcome(fn, jl or JL), outcome(fn, gloo or GLOO)
    if isinstance(theirs, Exception):
        global checks
        checks += 1
        return
    if isinstance(ours, Exception):
        raise AssertionError(f"rank {rank}: {what}: jacklring raised {ours!r} where gloo gave a result") from ours
    check(what, ours, theirs)


# ---- subgroups ---------------------------------------------------------------------------------
pair_jl, pair_gloo = dist.new_group([0, 2]), dist.new_group([0, 2], backend="gloo")
if rank in (0, 2):
    both("new_group [0,2] all_reduce", lambda g: (lambda t: (dist.all_reduce(t, group=g), t)[1])(data(torch.float32, 9)),
         pair_jl, pair_gloo)

    def pair_broadcast(g):  # src is a global rank; non-contiguous tensor
        t = data(torch.float32, 12).view(3, 4).t()
        dist.broadcast(t, src=2, group=g)
        return t
    both("new_group [0,2] broadcast src 2", pair_broadcast, pair_jl, pair_gloo)

    def pair_p2p(g):
        t = data(torch.int64, 5)
        if rank == 0:
            dist.send(t, dst=2, group=g)
            dist.recv(t, src=2, group=g)
        else:
            other = torch.empty_like(t)
            dist.recv(other, src=0, group=g)
            dist.send(t, dst=0, group=g)
            t = other
        return t
    both("new_group [0,2] send/recv", pair_p2p, pair_jl, pair_gloo)
else:
    assert pair_jl == dist.GroupMember.NON_GROUP_MEMBER
if rank in (1, 3):  # formed by its members only; torch names it after the count of
    # groups this rank belongs to, equal on ranks 1 and 3 here
    local = dist.new_group([1, 3], use_local_synchronization=True)
    t = torch.full((2,), float(rank))
    dist.all_reduce(t, group=local)
    check("new_group use_local_synchronization", t, torch.full((2,), 4.0))

lonely = dist.new_group([3])  # a group of one rank; the others are not in it
if rank == 3:
    t = torch.ones(3)
    dist.all_reduce(t, group=lonely)
    dist.barrier(group=lonely)
    check("group of one", t, torch.ones(3))

sub, _ = dist.new_subgroups(group_size=2)
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t, group=sub)
check("new_subgroups all_reduce", t, torch.full((4,), float(3 if rank < 2 else 7)))

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
for dim, partners in (("dp", (rank % 2, rank % 2 + 2)), ("tp", (rank // 2 * 2, rank // 2 * 2 + 1))):
    t = torch.full((3,), float(rank + 1))
    g = mesh.get_group(dim)
    assert dist.get_backend(g) == "jacklring", dist.get_backend(g)
    dist.all_reduce(t, group=g)
    check(f"2x2 mesh {dim} all_reduce", t, torch.full((3,), float(sum(p + 1 for p in partners))))
    out = torch.empty(2, 3)
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank)), group=g)
    check(f"2x2 mesh {dim} all_gather", out, torch.tensor([[float(p)] * 3 for p in partners]))

# gloo reads and writes a strided tensor's storage as if it were contiguous (it corrupted memory
# outside a sliced view in our runs), so its reference runs on contiguous copies of the same values.
def layout(t: torch.Tensor, g, rows: int) -> torch.Tensor:
    """On jacklring a transposed (non-contiguous) view of t's values, on gloo a contiguous tensor."""
    nc = t.view(-1, rows).t()
    return nc if g is JL else nc.contiguous()


# ---- all_to_all with uneven splits, zeros included ---------------------------------------------
send_rows = [(rank * 3 + q) % 4 for q in range(world)]   # rows rank sends to q (0 included)
recv_rows = [(q * 3 + rank) % 4 for q in range(world)]   # rows q sends to rank


def a2a_single(g):
    out = torch.full((sum(recv_rows), 3), -1.0)
    dist.all_to_all_single(out, data(torch.float32, 3 * sum(send_rows)).view(-1, 3), recv_rows, send_rows, group=g)
    return out
both("all_to_all_single uneven splits with zeros", a2a_single)


def a2a_single_only_out_splits(g):  # input split evenly, output split given
    out = torch.empty(world * 2, dtype=torch.int64)
    dist.all_to_all_single(out, data(torch.int64, world * 2), [2] * world, group=g)
    return out
both("all_to_all_single, output splits only", a2a_single_only_out_splits)


def a2a_list(g):
    outs = [torch.full((recv_rows[q], 2), -1.0) for q in range(world)]
    ins = [data(torch.float32, 2 * send_rows[q], q).view(-1, 2) for q in range(world)]
    dist.all_to_all(outs, ins, group=g)
    return outs
both("all_to_all uneven with zeros", a2a_list)


def a2a_noncontig(g):
    outs = [layout(torch.zeros(6), g, 2) for _ in range(world)]
    ins = [layout(data(torch.float32, 6, q), g, 2) for q in range(world)]
    dist.all_to_all(outs, ins, group=g)
    return outs
both("all_to_all non-contiguous", a2a_noncontig)

# ---- rooted ops at non-zero roots on non-contiguous tensors ------------------------------------
for root in (1, 3):
    for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR):
        def rd(g, op=op, root=root):
            t = layout(data(torch.int32, 12).clamp(-2, 2), g, 3)
            dist.reduce(t, dst=root, op=op, group=g)
            return t if rank == root else []
        both(f"reduce {op} dst {root} non-contiguous", rd)

    def bc(g, root=root):
        base = data(torch.float64, 20).view(4, 5)
        t = base[:, 1:4] if g is JL else base[:, 1:4].contiguous()  # a strided slice
        dist.broadcast(t, src=root, group=g)
        return [t, base[:, 0], base[:, 4]]  # the columns outside the slice stay untouched
    both(f"broadcast src {root} strided slice", bc)

    def ga(g, root=root):
        out = [layout(torch.zeros(6), g, 2) for _ in range(world)] if rank == root else None
        dist.gather(layout(data(torch.float32, 6), g, 2), out, dst=root, group=g)
        return out or []
    both(f"gather dst {root} non-contiguous", ga)

    def sc(g, root=root):
        out = layout(torch.zeros(6), g, 2)
        ins = [layout(data(torch.float32, 6, q), g, 2) for q in range(world)] if rank == root else None
        dist.scatter(out, ins, src=root, group=g)
        return out
    both(f"scatter src {root} non-contiguous", sc)

# ---- object collectives ------------------------------------------------------------------------
def obj(q: int) -> dict:
    return {"rank": q, "payload": "x" * (q * 37), "nested": [q, (q, 2.5), None]}


def objects(g):
    out = []
    gathered = [None] * world
    dist.all_gather_object(gathered, obj(rank), group=g)
    out.append(gathered)
    lst = [obj(2), obj(0)] if rank == 2 else [None, None]
    dist.broadcast_object_list(lst, src=2, group=g)
    out.append(lst)
    gl = [None] * world if rank == 1 else None
    dist.gather_object(obj(rank), gl, dst=1, group=g)
    out.append(gl)
    sl = [None]
    dist.scatter_object_list(sl, [obj(q + 10) for q in range(world)] if rank == 3 else None, src=3, group=g)
    out.append(sl)
    if rank in (0, 3):
        peer = 3 - rank
        box = [obj(rank), "second"] if rank == 0 else [None, None]
        if rank == 0:
            dist.send_object_list(box, dst=peer, group=g)
        else:
            dist.recv_object_list(box, src=peer, group=g)
        out.append(box)
    return out


ours, theirs = objects(JL), objects(GLOO)
assert ours == theirs, f"rank {rank}: object collectives: {ours!r} != gloo {theirs!r}"
checks += 1

# ---- every dtype x reduce op (gloo's answers; where gloo refuses, jacklring must refuse too) ----
for dtype in (torch.bool, torch.int8, torch.uint8, torch.bfloat16, torch.float16, torch.complex64,
              torch.float64):
    for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR, R.AVG):
        def ar(g, op=op, dtype=dtype):
            t = data(dtype, 33)
            if dtype.is_floating_point and op == R.PRODUCT:
                t = t.clamp(-2, 2)
            dist.all_reduce(t, op=op, group=g)
            return t
        ours, theirs = outcome(ar, JL), outcome(ar, GLOO)
        if isinstance(theirs, Exception):
            # Documented superset: integer AVG (sum, then divide truncating, as NCCL does).
            superset = op == R.AVG and not dtype.is_floating_point and dtype != torch.bool
            assert superset or isinstance(ours, Exception), \
                f"rank {rank}: all_reduce {op} {dtype}: gloo raises ({theirs!r}) but jacklring returned {ours}"
            continue
        if isinstance(ours, Exception):
            raise AssertionError(f"rank {rank}: all_reduce {op} {dtype}: jacklring raised {ours!r}") from ours
        check(f"all_reduce {op} {dtype}", ours, theirs)

def sparse(g):  # different nnz per rank, duplicate indices, 2-D values
    idx = torch.tensor([[rank % 3, 4, 4, rank][:rank + 1]])
    t = torch.sparse_coo_tensor(idx, data(torch.float32, 2 * (rank + 1)).view(-1, 2), (6, 2))
    work = dist.all_reduce(t, group=g, async_op=True)
    work.wait()
    return [t.to_dense(), work.get_future().wait()[0].to_dense()]
both("sparse all_reduce (in place and the future)", sparse)

# ---- 0-element tensors -------------------------------------------------------------------------
def empties(g):
    res = []
    t = torch.empty(0)
    dist.all_reduce(t, group=g)
    res.append(t)
    t = torch.empty(0, 3, dtype=torch.int64)
    dist.broadcast(t, src=1, group=g)
    res.append(t)
    out = torch.empty(0)
    dist.all_gather_into_tensor(out, torch.empty(0), group=g)
    res.append(out)
    outs = [torch.empty(0) for _ in range(world)]
    dist.all_gather(outs, torch.empty(0), group=g)
    res += outs
    out = torch.empty(0)
    dist.reduce_scatter_tensor(out, torch.empty(0), group=g)
    res.append(out)
    out = torch.empty(0)
    dist.all_to_all_single(out, torch.empty(0), group=g)
    res.append(out)
    if rank < 2:
        t = torch.empty(0)
        (dist.send if rank == 0 else dist.recv)(t, 1 - rank, group=g)
        res.append(t)
    return res
both("0-element tensors", empties)

# ---- tags: both orders to the same peer ---------------------------------------------------------
def tagged(g):
    if rank == 0:
        a, b = torch.full((5,), 1.0), torch.full((5,), 2.0)
        works = [dist.isend(a, dst=1, tag=11, group=g), dist.isend(b, dst=1, tag=22, group=g)]
        for w in works:
            w.wait()
        return []
    if rank == 1:
        x, y = torch.zeros(5), torch.zeros(5)
        works = [dist.irecv(y, src=0, tag=22, group=g), dist.irecv(x, src=0, tag=11, group=g)]  # reverse order
        for w in works:
            w.wait()
        return [x, y]
    return []
both("isend/irecv tags received in the other order", tagged)

# ---- Work.wait(timeout): raises on time-out, the work still completes -------------------------
def wait_timeout(g):
    t = torch.full((8,), float(rank))
    if rank == 1:
        time.sleep(1.0)
    work = dist.all_reduce(t, group=g, async_op=True)
    raised = None
    if rank == 0:
        try:
            work.wait(timeout=datetime.timedelta(milliseconds=100))
        except RuntimeError as exc:
            raised = exc
        assert raised is not None, f"{g}: Work.wait(timeout=0.1 s) returned before the peer joined"
    work.wait()
    return t
both("Work.wait(timeout) then wait()", wait_timeout)
dist.barrier()  # device_ids absent

# ---- two groups with collectives in flight from two threads ------------------------------------
g_a, g_b = dist.new_group(), dist.new_group()
results: dict[str, torch.Tensor] = {}
errors: list[BaseException] = []


def hammer(name: str, g, salt: float) -> None:
    try:
        t = torch.zeros(50_000)
        for i in range(20):
            x = torch.full((50_000,), float(rank) + salt + i)
            dist.all_reduce(x, group=g)
            t += x
        results[name] = t
    except BaseException as exc:  # reported by the main thread
        errors.append(exc)


threads = [threading.Thread(target=hammer, args=("a", g_a, 0.0)), threading.Thread(target=hammer, args=("b", g_b, 0.5))]
for th in threads:
    th.start()
for th in threads:
    th.join(60)
assert not errors and all(not th.is_alive() for th in threads), errors
base = sum(range(world))
check("thread a", results["a"], torch.full((50_000,), float(sum(base + world * i for i in range(20)))))
check("thread b", results["b"], torch.full((50_000,), float(sum(base + world * (0.5 + i) for i in range(20)))))

dist.destroy_process_group()
print(f"rank {rank}: {checks} checks ALL OK", flush=True)
