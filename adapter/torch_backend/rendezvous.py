"""Forming the adapter communicator behind a torch "jacklring" process group.

Which backend runs underneath: pg_options (a JacklringOptions, a dict {"backend": ...} or a
string) else JACKLRING_TORCH_BACKEND, else "auto":
  auto  the MPI backend when launched by mpirun, else JACCL when its environment is present
        and agrees with the group's rank and size, else the ring
  ring  under our launcher (MLX_RANK / MLX_HOSTFILE agreeing with the group's rank and size)
        the launcher's hostfile; otherwise a ring whose addresses are exchanged through the
        c10d store torch hands the creator (torchrun, env://, tcp://, file://)
  mpi, jaccl, nccl, any   that adapter backend from its environment (adapter.init)
Environment-configured backends serve the default group only, and only when their rank and
size agree with torch's; subgroups (new_group, device meshes) always form a store ring.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import zlib
from dataclasses import dataclass

from .. import config
from ..backends import registry
from ..backends.base import Backend
from ..backends.singleton import SingletonBackend
from ..errors import ConfigError, DistributedError
from ..rendezvous.store_ring import store_ring

log = logging.getLogger("jacklring.torch")

CHOICES = ("auto", "ring", "mpi", "jaccl", "nccl", "any")
ENV_BACKEND = "JACKLRING_TORCH_BACKEND"


@dataclass
class JacklringOptions:
    """pg_options for init_process_group / new_group: which adapter backend runs underneath."""

    backend: str = "auto"


def backend_choice(pg_options: object) -> str:
    if pg_options is None:
        choice = config.get(ENV_BACKEND)
        where = ENV_BACKEND
    elif isinstance(pg_options, str):
        choice, where = pg_options, "pg_options"
    elif isinstance(pg_options, dict):
        choice, where = pg_options.get("backend", "auto"), "pg_options['backend']"
    elif hasattr(pg_options, "backend"):
        choice, where = getattr(pg_options, "backend"), "pg_options.backend"
    else:
        raise ConfigError(f"jacklring: pg_options must be a JacklringOptions, a dict or a backend name, "
                          f"not {type(pg_options).__name__}")
    choice = str(choice).strip().lower()
    if choice not in CHOICES:
        raise ConfigError(f"jacklring: {where}={choice!r}; choose one of {', '.join(CHOICES)}")
    return choice


def create_backend(store, rank: int, size: int, timeout_s: float, choice: str,
                   is_default: bool, group_id: str = "") -> tuple[Backend, str]:
    """The communicator for one torch process group of `size` ranks, and where it came from
    ("single rank", "environment" or "store"). group_id: torch's name of the group (the same on
    every member), which numbers its formations on a store that outlives it."""
    if size == 1:
        return SingletonBackend(), "single rank"
    if is_default:
        from_env = _from_environment(rank, size, timeout_s, choice)
        if from_env is not None:
            return from_env, "environment"
    elif choice not in ("auto", "ring", "any"):
        log.debug("jacklring: subgroup of %d ranks uses a store ring (%s serves the default group only)", size, choice)
    why = ("it is the ring of a torch process group (init_process_group), which cannot take in a process that is "
           "not one of its ranks")
    return store_ring(store, rank, size, timeout_s, scope=f"pg/{group_id}", growth=why), "store"


def _environment_backend(choice: str) -> str | None:
    """The adapter backend to start from the environment, or None for a store ring."""
    if choice == "ring":
        return "ring" if registry.probe("ring") is None else None
    if choice == "auto":
        if registry.probe("mpi") is None:
            return "mpi"
        if registry.probe("jaccl") is None:
            return "jaccl"
        return "ring" if registry.probe("ring") is None else None
    if choice == "any":
        for name in registry.ANY_ORDER:
            if registry.probe(name) is None:
                return name
        return None
    reason = registry.probe(choice)
    if reason is not None:
        raise ConfigError(f"jacklring: the {choice} backend was requested but cannot start: {reason}")
    return choice


def _from_environment(rank: int, size: int, timeout_s: float, choice: str) -> Backend | None:
    from .. import group

    name = _environment_backend(choice)
    if name is None:
        return None
    if name == "ring" and not _ring_env_agrees(rank, size):
        return None
    if name == "jaccl" and choice == "auto" and not _jaccl_env_agrees(rank, size):
        return None
    # adapter.init caches the group, so the numpy API and torch share one set of connections;
    # torch gets a private split so the two never interleave collectives.
    base = group.init(backend=name, timeout=timeout_s).backend
    if base.rank() != rank or base.size() != size:
        if choice in ("auto", "ring", "any"):
            return None
        raise ConfigError(f"jacklring: the {name} environment says rank {base.rank()} of {base.size()} but "
                          f"init_process_group was given rank {rank} of {size}")
    backend = base.split(0, rank)
    backend.set_timeout(timeout_s)
    return backend


def _ring_env_agrees(rank: int, size: int) -> bool:
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            hosts = json.load(f)
        return int(os.environ["MLX_RANK"]) == rank and isinstance(hosts, list) and len(hosts) == size
    except (OSError, ValueError, KeyError):
        return False


def _jaccl_env_agrees(rank: int, size: int) -> bool:
    try:
        with open(os.environ["MLX_IBV_DEVICES"]) as f:
            matrix = json.load(f)
        return int(os.environ["MLX_RANK"]) == rank and isinstance(matrix, list) and len(matrix) == size
    except (OSError, ValueError, KeyError):
        return False


# ---- torch's env:// variables from Slurm or MPI ---------------------------------------------

def fill_torch_env(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> dict[str, str]:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from an srun step, an
    MPI launcher or mlx.launch's MLX_* variables (mlx_env.py) when RANK and WORLD_SIZE are
    both absent, so init_process_group("jacklring")
    (env://, torch's default) works under plain srun or mpirun. Returns what was set; never
    overrides a variable the user set. MASTER_ADDR: the step's first node under Slurm (task 0
    runs there), 127.0.0.1 for an MPI job on one host; a multi-host MPI job needs the user's
    (mpirun -x MASTER_ADDR=<rank 0's host>). MASTER_PORT: derived from the job's identity, so
    every rank agrees without talking."""
    from .. import engines

    if environ.get("RANK") or environ.get("WORLD_SIZE"):
        return {}
    from .mlx_env import mlx_torch_env

    wanted = _slurm_torch_env(environ, engines) or _mpi_torch_env(environ, engines) or mlx_torch_env(environ)
    added = {k: v for k, v in wanted.items() if not environ.get(k)}
    environ.update(added)
    if added:
        log.debug("jacklring: torch variables from the scheduler: %s", added)
    return added


def _slurm_torch_env(environ, engines) -> dict[str, str]:
    try:
        if not all(environ.get(v) for v in ("SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEP_NODELIST")):
            return {}  # not an srun step (a batch script's own shell has no step node list)
        rank, size = engines.slurm_world(environ)
        mpi = engines.mpi_world(environ)
        if mpi is not None and mpi != (rank, size):
            return {}  # mpirun inside an allocation: its world, not the batch step's
        host, port = engines.slurm_rendezvous(environ)
    except (DistributedError, KeyError, ValueError):
        return {}
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
            "MASTER_ADDR": host, "MASTER_PORT": str(port)}


def _mpi_torch_env(environ, engines) -> dict[str, str]:
    try:
        world = engines.mpi_world(environ)
    except DistributedError:
        return {}
    if world is None:
        return {}
    rank, size = world
    env = {"RANK": str(rank), "WORLD_SIZE": str(size)}
    local_rank, local_size = environ.get("OMPI_COMM_WORLD_LOCAL_RANK"), environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if local_rank is not None:
        env["LOCAL_RANK"] = local_rank
    if local_size is not None and local_size == str(size):
        env["MASTER_ADDR"] = "127.0.0.1"  # the whole job is on this host
    job = environ.get("PMIX_NAMESPACE") or environ.get("OMPI_MCA_ess_base_jobid") or environ.get("PMI_JOBID")
    if job:
        env["MASTER_PORT"] = str(20000 + zlib.crc32(job.encode()) % 12000)
    return env


def deadline_seconds(timeout: object) -> float:
    if timeout is None:
        from ..config import op_timeout

        return op_timeout()
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if not seconds > 0:
        raise ConfigError(f"jacklring: timeout {timeout!r} must be positive")
    return seconds

