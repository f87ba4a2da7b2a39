"""Every collective on the jacklring group against the same call on a gloo group of the same
ranks (or, where gloo has no such op, against the value computed locally). Prints ALL OK."""
from __future__ import annotations

import torch
import torch.distributed as dist
from common import init
from torch.distributed.distributed_c10d import _coalescing_manager

rank, world = init()
JL = dist.group.WORLD
GLOO = dist.new_group(backend="gloo")
R = dist.ReduceOp
checks = 0


def data(dtype: torch.dtype, n: int, salt: int = 0, q: int | None = None) -> torch.Tensor:
    """Small integer values (exact in every dtype and under any summation order), per rank."""
    q = rank if q is None else q
    g = torch.Generator().manual_seed(1000 * q + 17 * n + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    hi = 4 if dtype in (torch.float16, torch.bfloat16, torch.uint8, torch.int8) else 50
    lo = 1 if dtype == torch.uint8 else -hi
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def check(what: str, got, want) -> None:
    global checks
    got = got if isinstance(got, (list, tuple)) else [got]
    want = want if isinstance(want, (list, tuple)) else [want]
    assert len(got) == len(want), f"{what}: {len(got)} results, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        ok = torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a.double(), b.double(), rtol=1e-6, atol=1e-6)
        assert ok, f"rank {rank}: {what}[{i}]: jacklring {a.flatten()[:8]} != expected {b.flatten()[:8]}"
    checks += 1


def both(what: str, fn) -> None:
    """fn(group) -> result tensors; run on jacklring and on gloo with the same inputs."""
    check(what, fn(JL), fn(GLOO))


# ---- all_reduce: every op, dtypes, small (one-pass) and large (pipelined ring) sizes ----------
OPS = {R.SUM: [torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16, torch.float16, torch.uint8],
       R.PRODUCT: [torch.float32, torch.int64], R.MIN: [torch.float32, torch.int32, torch.bfloat16],
       R.MAX: [torch.float64, torch.int64, torch.uint8], R.BAND: [torch.int32, torch.uint8, torch.bool],
       R.BOR: [torch.int64, torch.bool], R.BXOR: [torch.int32, torch.int8]}
for op, dtypes in OPS.items():
    for dtype in dtypes:
        for n in (7, 40_000):
            def run(g, op=op, dtype=dtype, n=n):
                t = data(dtype, n)
                if op == R.PRODUCT:
                    t = t.clamp(-2, 2) if dtype != torch.uint8 else t
                dist.all_reduce(t, op=op, group=g)
                return t
            both(f"all_reduce {op} {dtype} n={n}", run)

for dtype in (torch.float32, torch.int64):  # AVG: gloo has none; SUM / world on gloo
    t = data(dtype, 1000) * world
    ref = t.clone()
    dist.all_reduce(t, op=R.AVG, group=JL)
    dist.all_reduce(ref, op=R.SUM, group=GLOO)
    check(f"all_reduce AVG {dtype}", t, torch.div(ref, world, rounding_mode="trunc") if dtype == torch.int64 else ref / world)

def noncontig(g):
    t = data(torch.float32, 60).view(6, 10).t()  # a transposed (non-contiguous) view
    dist.all_reduce(t, group=g)
    return t
both("all_reduce non-contiguous", noncontig)

def async_future(g):
    t = data(torch.float32, 100)
    fut = dist.all_reduce(t, group=g, async_op=True).get_future()
    return fut.wait()[0].clone()
both("all_reduce future value", async_future)

def coalesced(g):
    ts = [data(torch.float32, 5, i) for i in range(3)] + [data(torch.int64, 4, 9)]
    with _coalescing_manager(group=g, async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t, group=g)
    cm.wait()
    return ts
check("coalescing manager all_reduce", coalesced(JL),
      [data(torch.float32, 5, i, q=0) * 0 + sum(data(torch.float32, 5, i, q=q) for q in range(world)) for i in range(3)]
      + [sum(data(torch.int64, 4, 9, q=q) for q in range(world))])

def coalesced_api(g):
    ts = [data(torch.float32, 6, i) for i in range(3)]
    g.allreduce_coalesced(ts).wait()
    return ts
check("allreduce_coalesced", coalesced_api(JL), [sum(data(torch.float32, 6, i, q=q) for q in range(world)) for i in range(3)])

# ---- all_gather family -------------------------------------------------------------------------
for dtype, n in ((torch.float32, 9), (torch.bfloat16, 30_000), (torch.int64, 1)):
    def ag(g, dtype=dtype, n=n):
        out = [torch.empty(n, dtype=dtype) for _ in range(world)]
        dist.all_gather(out, data(dtype, n), group=g)
        return out
    both(f"all_gather {dtype} n={n}", ag)

    def agt(g, dtype=dtype, n=n):
        out = torch.empty(world * n, dtype=dtype)
        dist.all_gather_into_tensor(out, data(dtype, n), group=g)
        return out
    both(f"all_gather_into_tensor {dtype} n={n}", agt)

def ag_single(g):
    out = torch.empty(world, 4)
    dist.all_gather_single(out, data(torch.float32, 4).view(1, 4), group=g)
    return out
both("all_gather_single 2-D", ag_single)

def ag_in_place(g):  # FSDP's pattern: the input is this rank's slice of the output
    out = torch.zeros(world * 8)
    out[rank * 8:(rank + 1) * 8] = data(torch.float32, 8)
    dist.all_gather_into_tensor(out, out[rank * 8:(rank + 1) * 8], group=g)
    return out
both("all_gather_into_tensor in place", ag_in_place)

uneven = [torch.empty(q + 2) for q in range(world)]  # rank q contributes q + 2 elements
dist.all_gather(uneven, data(torch.float32, rank + 2), group=JL)
check("all_gather uneven sizes", uneven, [data(torch.float32, q + 2, q=q) for q in range(world)])

def ag_noncontig_out(g):
    big = torch.zeros(4, world * 3)
    outs = [big[1, q * 3:(q + 1) * 3] for q in range(world)]
    outs = [big[:, q][:3] for q in range(world)]  # strided views
    dist.all_gather(outs, data(torch.float32, 3), group=g)
    return big
both("all_gather into strided views", ag_noncontig_out)

def ag_coalesced(g):
    ins = [data(torch.float32, 3, 1), data(torch.float32, 5, 2)]
    outs = [torch.empty(world * 3), torch.empty(world * 5)]
    with _coalescing_manager(group=g, async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i, group=g)
    cm.wait()
    return outs
check("coalesced all_gather_into_tensor", ag_coalesced(JL),
      [torch.cat([data(torch.float32, 3, 1, q=q) for q in range(world)]),
       torch.cat([data(torch.float32, 5, 2, q=q) for q in range(world)])])

objs = [None] * world
dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank}, group=JL)
assert objs == [{"rank": q, "s": "x" * q} for q in range(world)], objs
checks += 1

# ---- reduce_scatter family ---------------------------------------------------------------------
for op in (R.SUM, R.MAX, R.PRODUCT):
    for n in (3, 20_000):
        def rs(g, op=op, n=n):
            out = torch.empty(n)
            dist.reduce_scatter(out, [data(torch.float32, n, q).clamp(-2, 2) for q in range(world)], op=op, group=g)
            return out
        both(f"reduce_scatter {op} n={n}", rs)

        def rst(g, op=op, n=n):
            out = torch.empty(n)
            dist.reduce_scatter_tensor(out, data(torch.float32, world * n).clamp(-2, 2), op=op, group=g)
            return out
        both(f"reduce_scatter_tensor {op} n={n}", rst)

out = torch.empty(4)
dist.reduce_scatter_tensor(out, data(torch.float32, world * 4) * world, op=R.AVG, group=JL)
check("reduce_scatter_tensor AVG", out, sum(data(torch.float32, world * 4, q=q) for q in range(world))[rank * 4:(rank + 1) * 4])

out = torch.empty(rank + 1)  # uneven blocks: rank q receives q + 1 elements
dist.reduce_scatter(out, [data(torch.float32, q + 1, 5) for q in range(world)], group=JL)
check("reduce_scatter uneven", out, sum(data(torch.float32, rank + 1, 5, q=q) for q in range(world)))

def rs_coalesced(g):
    outs = [torch.empty(2), torch.empty(3)]
    with _coalescing_manager(group=g, async_ops=True) as cm:
        for o in outs:
            dist.reduce_scatter_tensor(o, data(torch.float32, world * o.numel(), o.numel()), group=g)
    cm.wait()
    return outs
check("coalesced reduce_scatter_tensor", rs_coalesced(JL),
      [sum(data(torch.float32, world * m, m, q=q) for q in range(world))[rank * m:(rank + 1) * m] for m in (2, 3)])

# ---- rooted ops, all_to_all, barrier ---------------------------------------------------------------
for root in range(world):
    for n in (5, 50_000):
        def bc(g, root=root, n=n):
            t = data(torch.float32, n)
            dist.broadcast(t, src=root, group=g)
            return t
        both(f"broadcast root {root} n={n}", bc)

    for op in (R.SUM, R.MIN):
        def rd(g, root=root, op=op):
            t = data(torch.int64, 6)
            dist.reduce(t, dst=root, op=op, group=g)
            return t if rank == root else []  # gloo uses non-root tensors as scratch
        both(f"reduce {op} root {root}", rd)

    def ga(g, root=root):
        out = [torch.empty(4) for _ in range(world)] if rank == root else None
        dist.gather(data(torch.float32, 4), out, dst=root, group=g)
        return out or []
    both(f"gather root {root}", ga)

    def sc(g, root=root):
        out = torch.empty(3)
        dist.scatter(out, [data(torch.float32, 3, q) for q in range(world)] if rank == root else None, src=root, group=g)
        return out
    both(f"scatter root {root}", sc)

    objs = [f"obj{q}" if rank == root else None for q in range(world)]
    dist.broadcast_object_list(objs, src=root, group=JL)
    assert objs == [f"obj{q}" for q in range(world)], objs

def a2a(g):
    outs = [torch.empty(rank + 1) for q in range(world)]  # every rank sends rank r (r + 1) elements
    dist.all_to_all(outs, [data(torch.float32, q + 1, 7) for q in range(world)], group=g)
    return outs
check("all_to_all", a2a(JL), [data(torch.float32, rank + 1, 7, q=q) for q in range(world)])

def a2a_single(g):
    out = torch.empty(world * 2)
    dist.all_to_all_single(out, data(torch.float32, world * 2), group=g)
    return out
both("all_to_all_single even", a2a_single)

in_splits = [(rank + q) % 3 + 1 for q in range(world)]      # rank r sends (r + q) % 3 + 1 rows to q
out_splits = [(q + rank) % 3 + 1 for q in range(world)]
def a2a_splits(g):
    out = torch.empty(sum(out_splits), 2)
    dist.all_to_all_single(out, data(torch.float32, 2 * sum(in_splits)).view(-1, 2), out_splits, in_splits, group=g)
    return out
both("all_to_all_single with splits", a2a_splits)

dist.barrier(group=JL)
work = dist.barrier(group=JL, async_op=True)
work.wait()
assert work.is_completed()

# ---- names, subgroups ------------------------------------------------------------------------------
assert dist.get_backend(JL) == "jacklring", dist.get_backend(JL)
assert JL.name() == "jacklring" and JL.getBackendName() == "jacklring"
assert dist.get_world_size(JL) == world and dist.get_rank(JL) == rank

sub = dist.new_group([0, world - 1])
if rank in (0, world - 1):
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=sub)
    check("new_group all_reduce", t, torch.full((3,), float(world - 1)))
subgroups = dist.new_subgroups_by_enumeration([list(range(world - 1)), [world - 1]])[0]
t = torch.ones(2)
dist.all_reduce(t, group=subgroups)
check("new_subgroups_by_enumeration", t, torch.full((2,), float(world - 1 if rank < world - 1 else 1)))

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402  (needs the group formed above)

mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
t = torch.ones(2)
dist.all_reduce(t, group=mesh.get_group("dp"))
check("device mesh group", t, torch.full((2,), float(world)))

dist.destroy_process_group()
print(f"rank {rank}: {checks} checks ALL OK")
