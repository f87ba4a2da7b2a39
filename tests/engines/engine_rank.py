"""One rank started by an engine (torchrun, srun, mpirun, or plain torch variables).

    engine_rank.py MODE     prints one line: RESULT {"rank": r, "size": n, ...}

numpy            adapter.init(strict=True) and an all_sum of the ranks
grads            adapter.average_gradients(model) with rank-valued gradients, no torch group; an all_sum
torch-first      init_process_group(ENGINE_TEST_PG_BACKEND) first, then the numpy API over it; grow()
                 on its ring, on a split() of it and on the jacklring process group's ring is refused
ddp              init_process_group("jacklring"), a DDP step, then the numpy API beside it
torch-pg         init_process_group("jacklring") alone (rank and size from wherever torch finds them)
all              numpy API, then average_gradients, then init_process_group("jacklring") and a DDP step
elastic          torchrun --max-restarts: in the first attempt rank 1 fails after the group formed;
                 the restarted workers form the group again
elastic-early    torchrun --max-restarts: in the first attempt rank 1 exits 1 before it joins
                 (rank 0 already waits in adapter.init); the restarted workers form the group
elastic-early-pg the same with init_process_group("jacklring") and a torch all_reduce
                 (both: rank 1's "DIED" line and the results carry the stamps elastic-at's do)
elastic-at       torchrun --max-restarts: in the first attempt rank 1 dies (os._exit) at the moment
                 ENGINE_TEST_DIE_AT names: "forming" (inside init_process_group("jacklring"): it
                 read every rank's address, rank 0 is connecting to it) or "formed" (after the
                 first all_reduce, while rank 0 runs the next). Every line carries time.time()
                 stamps: rank 1's "DIED" line, and each result's start ("t0") and end ("t1"), and the
                 seconds init_process_group took ("forming_s")
"""
import json
import os
import sys
import time

STARTED = time.time()  # before the heavy imports: the process's start, for the restart timings

import numpy as np  # noqa: E402


def result(**fields) -> None:
    # One write of less than PIPE_BUF: ranks sharing a pipe (torchrun, srun) never split it.
    # (print() writes the text and the newline separately, so lines of two ranks could merge.)
    sys.stdout.write("RESULT " + json.dumps(fields) + "\n")
    sys.stdout.flush()


def ddp_step(rank: int, size: int) -> bool:
    """One DDP step from different initial weights; True when every replica ends equal."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(rank)  # DDP's broadcast must make the replicas equal
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.full((8, 4), float(rank))).sum().backward()
    opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(size)]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], t) for t in gathered)


def elastic_at(moment: str) -> None:
    import torch
    import torch.distributed as dist

    import adapter.torch_backend  # noqa: F401  (registers "jacklring")
    from adapter.rendezvous import store_records

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    sys.stdout.write(f"START {STARTED:.3f} attempt {attempt} rank {os.environ['RANK']}\n")
    dies = attempt == 0 and os.environ["RANK"] == "1"

    def die() -> None:
        sys.stdout.write(f"DIED {time.time():.3f} at {moment}\n")
        sys.stdout.flush()
        os._exit(1)

    if dies and moment == "forming":
        gather = store_records.RecordBook.gather

        def gather_then_die(self, mine, wait_s):
            gather(self, mine, wait_s)  # every address is in: rank 0 goes on to connect to this rank
            time.sleep(0.5)
            die()
        store_records.RecordBook.gather = gather_then_die
    joined = time.time()
    dist.init_process_group("jacklring")
    formed = time.time()
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    if dies and moment == "formed":
        die()
    dist.all_reduce(t)  # rank 0 of the first attempt meets the death here (or is stopped by torchrun)
    dist.destroy_process_group()
    result(rank=rank, size=size, sum=float(t[0]), attempt=attempt, t0=STARTED, forming_s=formed - joined, t1=time.time())


def grow_refusals(g, pg_backend: str) -> dict:
    """What grow() says on the rings no newcomer can join (the numpy API's over the torch group,
    a split() of it, and the jacklring process group's own), each followed by a collective on
    that ring to show the refusal left it usable: {which: [error type, message, sum after]}."""
    import torch
    import torch.distributed as dist

    import adapter

    def refusal(group, after) -> list:
        started = time.monotonic()
        try:
            group.grow(timeout=5)
            return ["grew"]
        except adapter.DistributedError as exc:
            return [type(exc).__name__, str(exc), after(), round(time.monotonic() - started, 3)]

    found = {"numpy": refusal(g, lambda: float(adapter.all_sum(np.array([1.0]), group=g)[0]))}
    sub = g.split(0)
    found["split"] = refusal(sub, lambda: float(adapter.all_sum(np.array([1.0]), group=sub)[0]))
    if pg_backend == "jacklring":
        # torch has no grow() for a process group: the ring under it (the default group is the
        # JacklringProcessGroup, or the one behind the C++ Backend) is reached through a private
        # attribute, to check the refusal that guards it
        from adapter.torch_backend.cpp_backend import python_group
        from adapter.torch_backend.process_group import JacklringProcessGroup

        pg = python_group(dist.group.WORLD, JacklringProcessGroup)  # also behind the C++ Backend

        def torch_sum() -> float:
            t = torch.ones(1)
            dist.all_reduce(t)
            return float(t[0])
        found["torch"] = refusal(adapter.Group(pg._comm), torch_sum)
    return found


def main(mode: str) -> None:
    import adapter

    if mode == "elastic":
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        g = adapter.init(strict=True)
        total = float(adapter.all_sum(np.array([float(g.rank())]))[0])
        if attempt == 0 and g.rank() == 1:
            raise SystemExit("rank 1 fails in the first attempt")
        if attempt == 0:
            time.sleep(30)  # torchrun stops this worker when rank 1 fails
        result(rank=g.rank(), size=g.size(), sum=total, attempt=attempt)
        return
    if mode in ("elastic-early", "elastic-early-pg"):
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if attempt == 0 and os.environ["RANK"] == "1":
            time.sleep(5)  # rank 0 is waiting for this rank's address by now
            sys.stdout.write(f"DIED {time.time():.3f} at joining\n")
            sys.stdout.flush()
            raise SystemExit(1)
        if mode == "elastic-early":
            joined = time.time()
            g = adapter.init(strict=True)
            formed = time.time()
            rank, size = g.rank(), g.size()
            total = float(adapter.all_sum(np.array([float(rank)]))[0])
        else:
            import torch
            import torch.distributed as dist

            import adapter.torch_backend  # noqa: F401  (registers "jacklring")

            joined = time.time()
            dist.init_process_group("jacklring")
            formed = time.time()
            rank, size = dist.get_rank(), dist.get_world_size()
            t = torch.tensor([float(rank)])
            dist.all_reduce(t)
            total = float(t[0])
            dist.destroy_process_group()
        result(rank=rank, size=size, sum=total, attempt=attempt, t0=STARTED, forming_s=formed - joined,
               t1=time.time())
        return
    if mode == "elastic-at":
        elastic_at(os.environ["ENGINE_TEST_DIE_AT"])
        return
    if mode == "all":
        import torch
        import torch.distributed as dist

        g = adapter.init(strict=True)
        fields = {"rank": g.rank(), "size": g.size(), "backend": g.backend_name,
                  "sum": float(adapter.all_sum(np.array([float(g.rank())]))[0])}
        model = torch.nn.Linear(3, 1)
        for p in model.parameters():
            p.grad = torch.full_like(p, float(g.rank()))
        adapter.average_gradients(model)
        fields["grads"] = sorted({float(v) for p in model.parameters() for v in p.grad.flatten()})
        import adapter.torch_backend

        adapter.torch_backend.fill_torch_env()  # under plain srun: RANK, WORLD_SIZE, MASTER_* for env://
        dist.init_process_group("jacklring")
        fields.update(torch_rank=dist.get_rank(), torch_size=dist.get_world_size(),
                      replicas_equal=ddp_step(dist.get_rank(), dist.get_world_size()))
        dist.destroy_process_group()
        result(**fields)
        return

    if mode == "numpy":
        g = adapter.init(strict=True)
        total = adapter.all_sum(np.array([float(g.rank())]))[0]
        result(rank=g.rank(), size=g.size(), sum=float(total), backend=g.backend_name)
    elif mode == "grads":
        import torch

        model = torch.nn.Linear(3, 1)
        for p in model.parameters():
            p.grad = torch.full_like(p, float(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))))
        adapter.average_gradients(model)
        g = adapter.init()
        result(rank=g.rank(), size=g.size(), grads=[float(v) for p in model.parameters() for v in p.grad.flatten()],
               sum=float(adapter.all_sum(np.array([float(g.rank())]))[0]))
    elif mode in ("torch-first", "ddp", "torch-pg"):
        import torch
        import torch.distributed as dist

        import adapter.torch_backend  # registers "jacklring"

        adapter.torch_backend.fill_torch_env()  # under plain srun or mpirun: RANK, WORLD_SIZE, MASTER_* for env://
        backend = os.environ.get("ENGINE_TEST_PG_BACKEND", "jacklring") if mode == "torch-first" else "jacklring"
        dist.init_process_group(backend)
        rank, size = dist.get_rank(), dist.get_world_size()
        fields = {"rank": rank, "size": size}
        if mode == "ddp":
            fields["replicas_equal"] = ddp_step(rank, size)
        if mode != "torch-pg":
            g = adapter.init(strict=True)
            if mode == "torch-first":
                fields["refusals"] = grow_refusals(g, backend)
            fields.update(adapter_rank=g.rank(), adapter_size=g.size(),
                          sum=float(adapter.all_sum(np.array([float(g.rank())]))[0]))
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        fields["torch_sum"] = float(t[0])
        dist.destroy_process_group()
        result(**fields)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1])
