"""Benchmark: nccl-tests style tables for all_sum, side by side with gloo, Open MPI and MLX.

    python -m adapter.bench -n 2                       # ring only
    python -m adapter.bench -n 2 --compare gloo,mpi    # + torch gloo and raw mpi4py Allreduce
    python -m adapter.bench -n 4 --backend ring,ring-tcp --compare mpi --sizes 4,4K,1M
    python -m adapter.bench -n 2 --api numpy,torch     # + adapter.all_sum and dist.all_reduce
    python -m adapter.bench -n 2 --compare gloo --plot allsum.png   # + a log-log picture

All backends live in the same processes and are timed in interleaved rounds (median of
rounds), so machine noise hits every column alike. Ranks start as users start them: jacklring's
columns in a job under `launcher -n N`, Open MPI's (mpi-sm, mpi-tcp, mpi-adapter) in jobs of
their own under the venv's mpirun (so they are not interleaved with ours); the table's caption
says so, and a placement probe (a cache line's round trip between CPUs 0 and 1) comes first.
busbw follows nccl-tests: all-reduce busbw = 2(n-1)/n * bytes / time.

ring is the ring backend as configured (on one host: shared memory); ring-unix and ring-tcp are
extra ring groups in the same processes forced onto Unix or TCP sockets, ring-1dir one whose large
reductions go one way round the ring only (JACKLRING_RING_DIRECTIONS=1). jaccl-flat is an extra
JACCL group that never uses shared memory (JACKLRING_LOCAL_TRANSPORT=unix: its mesh for every
collective, Unix sockets between the ranks of a host), where jaccl shares memory on each host
(in stages when the group spans hosts). mpi means both
mpi-sm (Open MPI's shared-memory BTL) and mpi-tcp (its TCP BTL): a BTL is chosen per job, so
every MPI variant after the first runs as a job of its own right after the main one (its column
is then not interleaved with the others). --api adds numpy-api (adapter.all_sum(src, out=dst) on the
default group, what the backend column does through the user's call), tensor-api (the same
call on torch tensors over src and dst) and torch-api (dist.all_reduce
in place on a tensor over dst, jacklring group; timed without refilling it, so its column has no copy
the others lack), with torch-floor beside it: the same call on a C++ c10d Backend that does
nothing (csrc/torch/floor.h, built by scripts/setup.sh), torch's own cost per call. A second
table gives rank 0's CPU time per call (time.process_time: every core it kept busy, spinning
included), which load on the machine inflates far less than wall time.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterator

import numpy as np

from jacklring_shared import ports as port_choice
from jacklring_shared.secret_text import drawn_secret_text

from .bench_report import FLOOR, human, parse_size, report  # report and parse_size: benchmarks/netns_bench.py too

DEFAULT_SIZES = "4,64,1K,4K,16K,64K,256K,1M,4M,16M,64M"
# Extra ring groups in the same processes, each formed with these settings.
RING_VARIANTS = {"ring-unix": {"JACKLRING_LOCAL_TRANSPORT": "unix"},
                 "ring-tcp": {"JACKLRING_LOCAL_TRANSPORT": "tcp"},
                 "ring-1dir": {"JACKLRING_RING_DIRECTIONS": "1"},
                 # The backend's own schedules only (as before the log-latency ones), beside them.
                 "ring-native": {"JACKLRING_ALGORITHM": "all_reduce=native"}}
# Extra JACCL groups, each formed with these settings at a coordinator of its own.
JACCL_VARIANTS = {"jaccl-flat": {"JACKLRING_LOCAL_TRANSPORT": "unix"},
                  "jaccl-native": {"JACKLRING_ALGORITHM": "all_reduce=native"}}
OURS = ("ring", *RING_VARIANTS, "jaccl", *JACCL_VARIANTS, "mpi-adapter")
OTHERS = ("gloo", "mpi-sm", "mpi-tcp", "mlx")
# --api: the user-facing calls over the configured group, beside the backend's own all_reduce.
APIS = {"numpy": "numpy-api", "tensor": "tensor-api", "torch": "torch-api"}
MPI_BTLS = {"mpi-sm": "self,sm", "mpi-tcp": "self,tcp"}


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """count distinct free TCP ports on host, below the ephemeral range (jacklring_shared.ports)."""
    return port_choice.free_ports([host] * count)


# ---- worker side ------------------------------------------------------------------------------

@contextlib.contextmanager
def _settings(settings: dict[str, str]) -> Iterator[None]:
    """The settings are read (through adapter.config) while a group forms: set them for that
    moment only, then put back whatever the user had."""
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


class Runner:
    """One backend's all_sum, timed identically for every library."""

    def __init__(self, name: str, rank: int, size: int) -> None:
        self.name = name
        self.check: Callable | None = None  # the correctness call, when the timed one differs
        self.checked = True  # whether its result is checked (the ok column)
        if name in ("ring", "jaccl", "mpi-adapter"):
            import adapter
            from adapter.backends.base import ReduceOp
            group = adapter.init(strict=True, backend=name.replace("-adapter", ""))
            backend = group.backend
            self.fn = lambda src, dst: backend.all_reduce(src, dst, ReduceOp.SUM)
        elif name in RING_VARIANTS:
            from adapter.backends.base import ReduceOp
            from adapter.backends.ring.backend import RingBackend, load_ring_hostfile
            addresses = load_ring_hostfile(os.environ[f"BENCH_HOSTFILE_{name[5:].upper()}"])
            with _settings(RING_VARIANTS[name]):
                backend = RingBackend.from_addresses(rank, addresses)
            self.fn = lambda src, dst: backend.all_reduce(src, dst, ReduceOp.SUM)
        elif name in JACCL_VARIANTS:
            from adapter.backends.base import ReduceOp
            from adapter.backends.jaccl import backend as jaccl
            coordinator = os.environ[f"BENCH_JACCL_{name[6:].upper()}_COORDINATOR"]
            with _settings(dict(JACCL_VARIANTS[name], MLX_JACCL_COORDINATOR=coordinator)):
                backend = jaccl.create()
            self.fn = lambda src, dst: backend.all_reduce(src, dst, ReduceOp.SUM)
        elif name == "numpy-api":
            import adapter
            adapter.init(strict=True)
            self.fn = _numpy_api_all_sum(adapter)
        elif name == "tensor-api":
            import torch

            import adapter
            adapter.init(strict=True)
            over: dict = {}

            def tensor_all_sum(src, dst):  # adapter.all_sum on tensors (tensor parallelism's call)
                # The tensors over src and dst are made once per buffer pair; the entry holds the
                # arrays, so their ids cannot be reused by other arrays while it is kept. Checking
                # addresses here instead (ndarray.ctypes) would cost more than the call timed.
                entry = over.get((id(src), id(dst)))
                if entry is None:
                    over.clear()
                    entry = over[(id(src), id(dst))] = (src, dst, torch.from_numpy(src), torch.from_numpy(dst))
                adapter.all_sum(entry[2], out=entry[3])
            self.fn = tensor_all_sum
        elif name in ("gloo", "torch-api", FLOOR):
            import torch
            import torch.distributed as dist
            group = _torch_group({"gloo": "gloo", "torch-api": "jacklring", FLOOR: "jacklring_floor"}[name], rank, size)
            over: dict = {}

            def torch_all_reduce(src, dst):  # in place on a tensor over dst, as a training step does
                entry = over.get(id(dst))  # (dst, its tensor): held, so the id stays dst's
                if entry is None:
                    over.clear()
                    entry = over[id(dst)] = (dst, torch.from_numpy(dst))
                dist.all_reduce(entry[1], group=group)

            def check(src, dst):
                dst[...] = src
                torch_all_reduce(src, dst)
            self.fn, self.check = torch_all_reduce, check
            self.checked = name != FLOOR  # the floor computes nothing: no result to check
        elif name in MPI_BTLS:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
            self.fn = lambda src, dst: comm.Allreduce(src, dst, op=MPI.SUM)
        elif name == "mlx":
            import mlx.core as mx
            # MLX's ring listens on its own ports: point it at a second hostfile while it starts.
            ours = os.environ["MLX_HOSTFILE"]
            os.environ["MLX_HOSTFILE"] = os.environ["BENCH_MLX_HOSTFILE"]
            try:
                world = mx.distributed.init(strict=True, backend="ring")
            finally:
                os.environ["MLX_HOSTFILE"] = ours
            def mlx(src, dst):
                dst[...] = np.array(mx.distributed.all_sum(mx.array(src), group=world))
            self.fn = mlx
        else:
            raise SystemExit(f"unknown backend {name}")


def _numpy_api_all_sum(adapter) -> Callable:
    """adapter.all_sum(src, out=dst), as the backend column's all_reduce(src, dst) (where this
    version has out=; else the result is copied into dst)."""
    probe = np.zeros(1, np.float32)
    try:
        adapter.all_sum(probe, out=probe)
    except TypeError:
        return lambda src, dst: np.copyto(dst, adapter.all_sum(src))
    return lambda src, dst: adapter.all_sum(src, out=dst)


def _torch_group(backend: str, rank: int, size: int):
    """The default group when it is of this backend (formed here if none), else a new one."""
    import torch.distributed as dist
    if backend == "jacklring_floor":
        from adapter.torch_backend import cpp_backend
        why = cpp_backend.register_floor()
        if why:
            raise SystemExit(f"bench: no {FLOOR} column: {why}")
    if backend == "jacklring":
        import adapter
        import adapter.torch_backend  # noqa: F401  registers the backend
        # The same backend as the numpy-api column (adapter.init()'s group): left to itself, a
        # jacklring group under mpirun runs over MPI, and the torch column would time MPI.
        os.environ.setdefault("JACKLRING_TORCH_BACKEND", adapter.init(strict=True).backend_name)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=size)
    if dist.get_backend() == backend:
        return None
    return dist.new_group(backend=backend)


def worker(args: argparse.Namespace) -> None:
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("MLX_RANK", "0")))
    size = args.n
    os.environ["MLX_RANK"] = str(rank)
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(size))
    runners = [Runner(name, rank, size) for name in args.backends]
    # Warm up every library (lazy connections, allocator, CPU clocks) before the first timing:
    # otherwise the first size pays for it and a 4-byte op looks five times slower than it is.
    # Several passes (the same count on every rank): right after mpirun starts, its daemons keep
    # a CPU busy for a second or so.
    warm = np.zeros(1024, np.float32)
    for _ in range(3):
        for r in runners:
            for _ in range(1000):
                r.fn(warm, np.empty_like(warm))
    results = {}
    for nbytes in args.sizes:
        count = max(1, nbytes // 4)
        src = (np.arange(count, dtype=np.float32) % 97) + rank
        dst = np.empty_like(src)
        expected = (np.arange(count, dtype=np.float32) % 97) * size + size * (size - 1) / 2
        iters = max(1, min(args.iters, int(args.budget_bytes // max(nbytes, 1))))
        for r in runners:  # warm-up and correctness
            (r.check or r.fn)(src, dst)
            ok = bool(np.array_equal(dst, expected)) if r.checked else None
            results.setdefault((nbytes, r.name), {"times": [], "cpu": [], "ok": ok})
        for _ in range(args.rounds):
            for r in runners:
                r.fn(src, dst)  # re-align the ranks before timing
                cpu = time.process_time()
                start = time.perf_counter()
                for _ in range(iters):
                    r.fn(src, dst)
                res = results[(nbytes, r.name)]
                res["times"].append((time.perf_counter() - start) / iters)
                res["cpu"].append((time.process_time() - cpu) / iters)
    if rank == 0:
        with open(args.results, "w") as f:
            json.dump([[nbytes, name, res["times"], res["ok"], res["cpu"]] for (nbytes, name), res in results.items()], f)
    if any(r.name in ("gloo", "torch-api", FLOOR) for r in runners):
        import torch.distributed as dist
        dist.destroy_process_group()


# ---- launcher side ----------------------------------------------------------------------------

def jobs(backends: list[str]) -> list[tuple[list[str], str | None]]:
    """(backends, Open MPI BTL list or None) per job: jacklring's columns (and every other
    non-MPI one) in one job started as users start it (`launcher -n N`), each Open MPI variant
    in a job of its own under mpirun (the BTL is chosen per job; mpi-adapter runs in the first)."""
    variants = [b for b in backends if b in MPI_BTLS]
    main = [b for b in backends if b not in MPI_BTLS and b != "mpi-adapter"]
    out: list[tuple[list[str], str | None]] = [(main, None)] if main else []
    mpi_adapter = ["mpi-adapter"] if "mpi-adapter" in backends else []
    if variants:
        out += [(mpi_adapter + variants[:1], MPI_BTLS[variants[0]])] + [([v], MPI_BTLS[v]) for v in variants[1:]]
    elif mpi_adapter:
        out.append((mpi_adapter, ""))
    return out


def placement() -> str:
    """The placement probe: a cache line's round trip between CPUs 0 and 1 (far placements make
    every same-host collective pay several times more for lines a peer just read)."""
    try:
        from adapter.backends.local import _engine
        ns = _engine.cache_line_round_trip(0, 1, 64, 200)
    except (ImportError, OSError) as exc:
        return f"# placement: not measured ({exc})"
    return (f"# placement: cache-line round trip CPU 0 <-> CPU 1 = {ns:.0f} ns (fastest of 64 batches; "
            f"on the 2-vCPU development VM near ~50-120 ns, far ~450-520 ns); load average {os.getloadavg()[0]:.1f}")


def contract_env(n: int, hosts: list[str], ports, tmp: str, connections: int,
                 backends: list[str]) -> dict[str, str]:
    """The environment contract for n ranks, rank r at hosts[r]: hostfiles for the ring (and the
    extra ring and MLX groups), MASTER_ADDR for gloo, the coordinator and devices for JACCL.
    ports yields port numbers free on those hosts."""
    def hostfile(name: str, per_rank: int) -> str:
        path = os.path.join(tmp, name)
        with open(path, "w") as f:
            json.dump([[f"{hosts[r]}:{next(ports)}" for _ in range(per_rank)] for r in range(n)], f)
        return path
    env = dict(MLX_HOSTFILE=hostfile("ring.json", connections),
               BENCH_HOSTFILE_UNIX=hostfile("ring-unix.json", connections),
               BENCH_HOSTFILE_TCP=hostfile("ring-tcp.json", connections),
               BENCH_HOSTFILE_1DIR=hostfile("ring-1dir.json", connections),
               BENCH_HOSTFILE_NATIVE=hostfile("ring-native.json", connections),
               BENCH_MLX_HOSTFILE=hostfile("mlx-ring.json", 1),
               MASTER_ADDR=hosts[0], MASTER_PORT=str(next(ports)), WORLD_SIZE=str(n))
    from adapter import config
    if len(set(hosts)) > 1 and not (config.get("JACKLRING_SECRET") or config.get("JACKLRING_SECRET_FILE")):
        env["JACKLRING_SECRET"] = drawn_secret_text()  # ranks on several hosts need one, as the launcher's do
    if any(b == "jaccl" or b in JACCL_VARIANTS for b in backends):
        devices = os.path.join(tmp, "devices.json")
        with open(devices, "w") as f:
            # Device names that exist nowhere: JACCL then runs over its TCP mesh.
            json.dump([[None if i == j else f"rdma_fake{j}" for j in range(n)] for i in range(n)], f)
        env.update(MLX_IBV_DEVICES=devices, MLX_JACCL_COORDINATOR=f"{hosts[0]}:{next(ports)}")
        for name in JACCL_VARIANTS:
            env[f"BENCH_JACCL_{name[6:].upper()}_COORDINATOR"] = f"{hosts[0]}:{next(ports)}"
    return env


def measure(args: argparse.Namespace, argv: list[str], env: dict, tmp: str,
            rank_prefix: Callable[[int], list[str]] | None = None,
            mpi_launch: list[str] | None = None) -> dict | None:
    """Run every job (see jobs()) and gather rank 0's timings; None when a job failed.
    rank_prefix(r): words put before rank r's command (e.g. `ip netns exec NAME`); mpi_launch:
    how mpirun starts and places the ranks of an MPI job (see run_job)."""
    results: dict = {}
    for i, (backends, btl) in enumerate(jobs(args.backends)):
        out = os.path.join(tmp, f"results{i}.json")
        cmd = [sys.executable, "-m", "adapter.bench", "--worker"] + argv + [
            "--only", ",".join(backends), "--results", out]
        if run_job(args, cmd, env, btl, rank_prefix, mpi_launch):
            return None
        with open(out) as f:
            for nbytes, name, times, ok, *cpu in json.load(f):
                results[(nbytes, name)] = {"times": times, "ok": ok, "cpu": cpu[0] if cpu else []}
    return results


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    n = args.n
    tmp = tempfile.mkdtemp(prefix="jacklring-bench-")
    ports = iter(free_ports(len(RING_VARIANTS) * n * args.connections + 2 * n + 2 + len(JACCL_VARIANTS)))
    env = dict(os.environ, **contract_env(n, ["127.0.0.1"] * n, ports, tmp, args.connections, args.backends))
    print(placement(), flush=True)
    results = measure(args, argv, env, tmp)
    if results is None:
        return 1
    print(f"# jacklring's columns ran in ranks started by `launcher -n {n}`"
          + (f"; Open MPI's in ranks started by `mpirun -n {n}` (a job of their own, so not interleaved "
             f"with ours)" if any(b in MPI_BTLS or b == "mpi-adapter" for b in args.backends) else ""))
    report(args, results, n)
    if args.plot:
        from .bench_plot import plot_results

        names = [name for name in args.backends if any(key[1] == name for key in results)]
        written = plot_results(args.plot, results, names, args.sizes, n, args.stat, size_label=human)
        print(f"bench: wrote {written} (time and busbw against size, log-log, one line per system)", file=sys.stderr)
    return 0


def find_mpirun() -> str:
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("bench: mpirun not found (pip install jacklring[mpi])")
    return mpirun


def run_job(args: argparse.Namespace, cmd: list[str], env: dict, btl: str | None,
            rank_prefix: Callable[[int], list[str]] | None = None,
            mpi_launch: list[str] | None = None) -> int:
    """Run cmd on every rank: through mpirun when btl is not None (mpi_launch: the words that
    start mpirun and place its ranks, default all on this host), else as n subprocesses, rank r
    behind rank_prefix(r)."""
    n = args.n
    if btl is not None:
        if rank_prefix is not None and mpi_launch is None:
            raise SystemExit("bench: Open MPI jobs start their ranks through mpirun, which takes no per-rank prefix")
        env = dict(env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        env.setdefault("OMPI_MCA_btl_tcp_if_include", "lo")
        if btl:
            env.update(OMPI_MCA_pml="ob1", OMPI_MCA_btl=btl)
        launch_words = mpi_launch or [find_mpirun(), "--oversubscribe", "-n", str(n)]
        try:
            return subprocess.call(launch_words + cmd, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"bench: timed out after {args.timeout} s", file=sys.stderr)
            return 1
    if rank_prefix is None:  # as users start ranks: the launcher (rank r's MLX_RANK and hostfile)
        launcher = [sys.executable, "-m", "launcher.cli", "-n", str(n), "--no-prefix"]
        try:
            return subprocess.call(launcher + cmd, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"bench: timed out after {args.timeout} s", file=sys.stderr)
            return 1
    prefix = rank_prefix
    procs = [subprocess.Popen(prefix(r) + cmd, env=dict(env, MLX_RANK=str(r))) for r in range(n)]
    try:
        codes = [p.wait(timeout=args.timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        print(f"bench: timed out after {args.timeout} s", file=sys.stderr)
        return 1
    return max(codes)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m adapter.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2, help="number of ranks (default 2)")
    ap.add_argument("--backend", default="ring",
                    help="our backends to measure, comma separated: ring, ring-unix, ring-tcp, ring-1dir, jaccl, "
                         "jaccl-flat, mpi-adapter")
    ap.add_argument("--compare", default="",
                    help="others in the same run, comma separated: gloo, mpi (= mpi-sm,mpi-tcp), mpi-sm, mpi-tcp, mlx")
    ap.add_argument("--api", default="",
                    help="the user-facing calls too, comma separated: numpy (adapter.all_sum), tensor "
                         "(adapter.all_sum on torch tensors), torch (dist.all_reduce on a jacklring group, in place)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes in bytes (default {DEFAULT_SIZES})")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per size (median reported)")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="which round to report: the median, or the fastest (on a shared, noisy machine)")
    ap.add_argument("--iters", type=int, default=50, help="iterations per round (fewer for big sizes)")
    ap.add_argument("--budget-bytes", type=float, default=256e6, help="cap on bytes per round per backend")
    ap.add_argument("--connections", type=int, default=1, help="ring connections per neighbour")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--plot", metavar="FILE", default="",
                    help="also draw time and busbw against size, log-log, one line per system, to FILE "
                         "(.png, .svg, .pdf; needs matplotlib: pip install 'jacklring[plot]')")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--only", default="", help=argparse.SUPPRESS)
    ap.add_argument("--results", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = list(dict.fromkeys(parse_size(s) for s in args.sizes.split(",") if s))
    apis = [a for a in args.api.split(",") if a]
    for a in apis:
        if a not in APIS:
            ap.error(f"unknown api {a!r}; choose from {', '.join(APIS)}")
    names = (args.only.split(",") if args.only
             else args.backend.split(",") + [APIS[a] for a in apis] + args.compare.split(","))
    names = [v for b in names if b for v in (("mpi-sm", "mpi-tcp") if b == "mpi" else (b,))]
    if "torch-api" in names and not args.only:
        names.append(FLOOR)  # every torch table shows torch's own cost beside ours
    args.backends = list(dict.fromkeys(names))
    for b in args.backends:
        if b not in OURS + OTHERS + tuple(APIS.values()) + (FLOOR,):
            ap.error(f"unknown backend {b!r}; choose from {', '.join(OURS + OTHERS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return launch(args, list(argv))


if __name__ == "__main__":
    sys.exit(main())
