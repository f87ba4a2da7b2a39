"""One rank of a fault test: form the FAULT_BACKEND group, then run the body in FAULT_BODY.

FAULT_BEFORE_INIT, when set, runs first (with r from MLX_RANK / RANK, say and os): a test patches
the library there to act at a chosen point of init.

The body sees r, n, np, os, sys, time, say(), the collectives all_sum / all_max / all_gather /
barrier / send / recv (numpy in, numpy out, whatever the backend) and ERRORS, the exception
types a communication failure may raise. say("TAG", ...) prints "TAG <rank> <monotonic> ...".
"""
import datetime
import os
import sys
import time

import numpy as np

BACKEND = os.environ["FAULT_BACKEND"]
r = int(os.environ.get("MLX_RANK", os.environ.get("RANK", "-1")))  # until the group says


def say(tag, *fields):
    print(tag, r, f"{time.monotonic():.4f}", *fields, flush=True)


def one_line(exc):
    return f"{type(exc).__name__} {exc}".replace("\n", " ")


say("START")
exec(compile(os.environ.get("FAULT_BEFORE_INIT", ""), "<fault before init>", "exec"))
from adapter.errors import DistributedError  # noqa: E402  (init's failures are all of this type)

if BACKEND == "torch":
    import torch
    import torch.distributed as dist

    import adapter.torch_backend

    adapter.torch_backend.register_backend()
    op_timeout = float(os.environ.get("JACKLRING_TIMEOUT", "30"))
    try:
        dist.init_process_group("jacklring", init_method="env://",
                                timeout=datetime.timedelta(seconds=op_timeout))
    except Exception as exc:
        say("INITERR", one_line(exc))
        sys.exit(4)
    r, n = dist.get_rank(), dist.get_world_size()
    ERRORS = (Exception,)  # torch may re-wrap; the tests check the type name it prints

    def all_sum(x):
        t = torch.from_numpy(np.ascontiguousarray(x).copy())
        dist.all_reduce(t)
        return t.numpy()

    def all_max(x):
        t = torch.from_numpy(np.ascontiguousarray(x).copy())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.numpy()

    def all_gather(x):
        t = torch.from_numpy(np.ascontiguousarray(x).copy())
        out = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(out, t)
        return torch.cat(out).numpy()

    def barrier():
        dist.barrier()

    def send(x, dst):
        dist.send(torch.from_numpy(np.ascontiguousarray(x)), dst)

    def recv(shape, dtype, src):
        t = torch.from_numpy(np.empty(shape, dtype))
        dist.recv(t, src)
        return t.numpy()
else:
    import importlib

    import adapter

    # adapter loads its modules on first use: load what init() runs before it is timed
    for module in ("adapter.group", "adapter.ops"):
        importlib.import_module(module)
    if BACKEND != "any":
        importlib.import_module(f"adapter.backends.{BACKEND}.backend")
    say("INIT")  # init() starts now: its connect deadline counts from here
    try:
        group = adapter.init(strict=True, backend=BACKEND)
    except DistributedError as exc:
        say("CULPRIT", getattr(exc, "culprit", None))  # the rank init() blamed (before INITERR)
        say("INITERR", one_line(exc))
        sys.exit(4)
    r, n = group.rank(), group.size()
    ERRORS = (adapter.DistributedError,)
    all_sum, all_max, all_gather = adapter.all_sum, adapter.all_max, adapter.all_gather
    barrier, send, recv = adapter.barrier, adapter.send, adapter.recv

exec(compile(os.environ["FAULT_BODY"], "<fault body>", "exec"))
