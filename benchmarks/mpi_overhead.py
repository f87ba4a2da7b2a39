"""What backend=mpi costs on top of raw mpi4py: float32 all-reduce, 2 ranks, 1 MiB .. 64 MiB.

    python benchmarks/mpi_overhead.py            # re-launches itself under the venv's mpirun -n 2
    mpirun -n 2 python benchmarks/mpi_overhead.py

Four ways, timed in interleaved rounds (a fresh shuffled order every round, the same on
both ranks, so no way always follows the one that just flushed the caches) and reported as
medians on rank 0, each call preceded by a barrier:
  raw        comm.Allreduce([src, MPI.FLOAT], [dst, MPI.FLOAT]) on its own Dup of COMM_WORLD
  backend    group.backend.all_reduce(src, dst, SUM): the MPI backend into the same preallocated dst
  raw+alloc  dst = np.empty_like(src); comm.Allreduce(...): raw mpi4py returning a new array
  all_sum    adapter.all_sum(src): the public op, which returns a new array (as mlx does)
"backend" vs "raw" is the backend's overhead; "all_sum" vs "raw+alloc" adds the ops layer.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
# 4 bytes first: there the difference between the columns is the pure per-call cost in microseconds.
SIZES = (4, 1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 32 * MIB, 64 * MIB)


def relaunch_under_mpirun() -> int:
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if mpirun is None:
        sys.exit("mpirun not found: pip install jacklring[mpi]")
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_btl_tcp_if_include", "lo")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    command = [mpirun, "--oversubscribe", "-n", "2", sys.executable, __file__, *sys.argv[1:]]
    return subprocess.call(command, env=env)


def rounds_for(nbytes: int) -> int:
    return 2000 if nbytes < MIB else max(16, 512 * MIB // nbytes)


def label(nbytes: int) -> str:
    return f"{nbytes // MIB:>4} MiB" if nbytes >= MIB else f"{nbytes:>6} B"


def duration(seconds: float) -> str:
    return f"{seconds * 1e3:>7.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:>7.1f} us"


def main() -> int:
    from adapter.backends.mpi import backend as mpi_backend

    if mpi_backend.probe() is not None:
        return relaunch_under_mpirun()

    from mpi4py import MPI

    import adapter
    from adapter import ReduceOp

    group = adapter.init(backend="mpi", strict=True)
    raw_comm = MPI.COMM_WORLD.Dup()
    rank, size = group.rank(), group.size()

    def timed(call) -> float:
        MPI.COMM_WORLD.Barrier()  # a third communicator, so neither timed one gets a head start
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    if rank == 0:
        print(f"float32 all-reduce, {size} ranks, Open MPI {MPI.Get_library_version().split(',')[0].split()[-1]}, "
              f"medians of interleaved rounds (rank 0)")
        print(f"{'size':>8} {'rounds':>6} {'raw':>10} {'busbw':>10} {'backend':>10} {'vs raw':>8} "
              f"{'raw+alloc':>10} {'all_sum':>10} {'vs r+a':>8}")
    for nbytes in SIZES:
        n = nbytes // 4
        src = np.full(n, rank + 1, np.float32)
        dst = np.empty_like(src)
        calls = {
            "raw": lambda: raw_comm.Allreduce([src, MPI.FLOAT], [dst, MPI.FLOAT], MPI.SUM),
            "backend": lambda: group.backend.all_reduce(src, dst, ReduceOp.SUM),
            "raw+alloc": lambda: raw_comm.Allreduce([src, MPI.FLOAT], [np.empty_like(src), MPI.FLOAT], MPI.SUM),
            "all_sum": lambda: adapter.all_sum(src),
        }
        names = list(calls)
        for name in names:  # warm up every path (user ops, page faults of dst)
            calls[name]()
        samples: dict[str, list[float]] = {name: [] for name in names}
        rounds = rounds_for(nbytes)
        shuffle = np.random.default_rng(nbytes)  # same seed on every rank: same order of collectives
        for _ in range(rounds):
            for name in shuffle.permutation(names):
                samples[name].append(timed(calls[name]))
        assert float(dst[0]) == sum(range(1, size + 1)), dst[0]
        if rank == 0:
            med = {name: statistics.median(values) for name, values in samples.items()}
            busbw = 2 * (size - 1) / size * src.nbytes / med["raw"] / 1e9
            backend_over = 100 * (med["backend"] / med["raw"] - 1)
            all_sum_over = 100 * (med["all_sum"] / med["raw+alloc"] - 1)
            print(f"{label(nbytes)} {rounds:>6} {duration(med['raw'])} {busbw:>5.2f} GB/s "
                  f"{duration(med['backend'])} {backend_over:>+7.1f}% "
                  f"{duration(med['raw+alloc'])} {duration(med['all_sum'])} {all_sum_over:>+7.1f}%", flush=True)
    raw_comm.Free()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
