"""The engines that can start a job besides our launcher, and how a group forms under each.

init(backend="any") tries these sources in order (SOURCES); the first whose environment is
present forms the group:

  nccl, jaccl, ring   the MLX variables (our launcher, mlx.launch, a hand-written hostfile)
  torch-group         a torch process group that already exists (any backend: gloo, nccl,
                      jacklring; Ray Train and Lightning create one): a ring formed through its store
  torchrun            RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun, Accelerate,
                      Lightning's launcher): a ring formed through torch's env:// store
  slurm               an srun step (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST):
                      a ring formed through a store on the step's first node, at a port derived
                      from the job and step ids
  mpi                 mpirun / srun --mpi=pmix (MPI's own world)

torchrun- and Slurm-style variables give way to MPI when MPI's world is the same one (our
launcher's --backend mpi also sets RANK and WORLD_SIZE) or, for Slurm, whenever an MPI
launcher started the process (mpirun inside an allocation inherits the batch step's Slurm
variables). An engine whose variables describe more than one rank but whose group cannot
form raises: every rank silently training alone would be worse.
"""
from __future__ import annotations

import datetime
import os
import re
import socket
import sys
from typing import Mapping

from . import config
from .backends import registry
from .backends.base import Backend
from .backends.singleton import SingletonBackend
from .errors import ConfigError, DistributedError

ENGINES = ("torch-group", "torchrun", "slurm")
# The one order of init(backend="any"): the backends' (registry.ANY_ORDER), with the engines
# tried just before MPI, whose variables a scheduler that started a ring or store job may set.
_BEFORE_MPI = registry.ANY_ORDER.index("mpi")
SOURCES = registry.ANY_ORDER[:_BEFORE_MPI] + ENGINES + registry.ANY_ORDER[_BEFORE_MPI:]
STORE_PREFIX = "jacklring/adapter/"
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 12000  # stays below Linux's ephemeral range (32768-60999)

# Stores rank 0 serves must outlive the rendezvous: peers may still be reading from them.
_stores: list = []


def probe(source: str) -> str | None:
    """None when the source's environment is present, else why it cannot form a group."""
    if source in registry.BACKENDS:
        return registry.probe(source)
    # A malformed engine variable (WORLD_SIZE=abc) raises ConfigError: it is present, not absent.
    return _PROBES[source](os.environ)


def create(source: str, timeout: float | None = None) -> Backend:
    """The communicator formed through the source (raises when it cannot form)."""
    if source in registry.BACKENDS:
        return registry.create(source, timeout)
    return _CREATES[source](os.environ, timeout)


# ---- MPI's world, as far as its launcher's variables tell ------------------------------------

def mpi_world(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(rank, size) from the variables mpirun (Open MPI, PMIx, MPICH/Hydra) sets, or None."""
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE"), ("PMIX_RANK", "PMIX_SIZE")):
        if env.get(rank_var) and env.get(size_var):
            return _int(env, rank_var), _int(env, size_var)
    return None


def _mpi_launched(env: Mapping[str, str]) -> bool:
    from .backends.mpi.backend import launched_by_mpirun

    return launched_by_mpirun(env)


# ---- an existing torch process group ---------------------------------------------------------

def _probe_torch_group(env: Mapping[str, str]) -> str | None:
    if "torch.distributed" not in sys.modules:  # never import torch just to look
        return "torch.distributed is not imported"
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return "no torch process group is initialized"
    return None


def _create_torch_group(env: Mapping[str, str], timeout: float | None) -> Backend:
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    if size == 1:
        return SingletonBackend()
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception as exc:  # a group created without a store (e.g. a fake or custom one)
        raise DistributedError(f"rank {rank}: the torch process group of {size} ranks has no store to form "
                               f"the numpy API's group through ({exc})") from None
    return _store_ring(store, rank, size, timeout, "the torch process group's store",
                       growth="it was formed through the store of an existing torch process group, which cannot "
                              "take in a process that is not one of its ranks (a newcomer would have no torch group)")


# ---- torchrun-style variables ----------------------------------------------------------------

def _probe_torchrun(env: Mapping[str, str]) -> str | None:
    if not (env.get("RANK") or env.get("WORLD_SIZE")):
        return "RANK and WORLD_SIZE not set"
    if env.get("WORLD_SIZE") and _int(env, "WORLD_SIZE") == 1:
        return "WORLD_SIZE=1"
    mpi = mpi_world(env)
    if mpi is not None and env.get("RANK") and env.get("WORLD_SIZE") \
            and mpi == (_int(env, "RANK"), _int(env, "WORLD_SIZE")):
        return "RANK and WORLD_SIZE describe the MPI world: the mpi backend forms it"
    return None


def _create_torchrun(env: Mapping[str, str], timeout: float | None) -> Backend:
    missing = [name for name in TORCHRUN_VARIABLES if not env.get(name)]
    if missing:
        said = ", ".join(f"{n}={env[n]}" for n in TORCHRUN_VARIABLES if env.get(n))
        raise ConfigError(
            f"{said} say this process is one of several ranks, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set, so no group can form (a framework that "
            "forms the torch process group later, such as Lightning, needs adapter.init() after it)")
    rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    _check_rank(rank, size, "RANK", "WORLD_SIZE")
    dist = _torch_distributed("torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    wait = datetime.timedelta(seconds=config.connect_timeout())
    where = f"MASTER_ADDR={env['MASTER_ADDR']} MASTER_PORT={env['MASTER_PORT']}"
    # torchrun's agent serves the store when it says so; otherwise (env:// alone) rank 0 does.
    source = _store_source(f"the torch store at {where}", env.get("TORCHELASTIC_USE_AGENT_STORE") != "True")
    _refuse_joining_at_slot_0(rank, source)
    try:
        # torch's own env:// rendezvous: the agent's store under torchrun, else rank 0 serves one
        # (multi-tenant, so a later init_process_group in this process shares it).
        store, _, _ = next(dist.rendezvous("env://", rank, size, timeout=wait))
    except Exception as exc:
        raise DistributedError(f"rank {rank}: cannot reach the torch store at {where}: {exc}") from None
    _stores.append(store)
    return _store_ring(store, rank, size, timeout, f"the torch store at {where}", growth=source)


# ---- Slurm -----------------------------------------------------------------------------------

def _probe_slurm(env: Mapping[str, str]) -> str | None:
    if not env.get("SLURM_PROCID"):
        return "SLURM_PROCID not set (not an srun step)"
    if not env.get("SLURM_STEP_ID") or not env.get("SLURM_STEP_NODELIST"):
        return "not inside an srun step (SLURM_STEP_ID or SLURM_STEP_NODELIST not set)"
    if _mpi_launched(env):
        return "started by an MPI launcher: the mpi backend forms the group"
    if slurm_world(env)[1] == 1:
        return "a Slurm step of one task"
    return None


def slurm_world(env: Mapping[str, str]) -> tuple[int, int]:
    """(rank, size) of this srun step."""
    size_var = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    if not env.get(size_var):
        raise ConfigError("SLURM_PROCID is set but neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is")
    rank, size = _int(env, "SLURM_PROCID"), _int(env, size_var)
    _check_rank(rank, size, "SLURM_PROCID", size_var)
    return rank, size


def slurm_rendezvous(env: Mapping[str, str]) -> tuple[str, int]:
    """(host, port) where task 0 of the step serves the store: the step's first node (Slurm
    always places task 0 there) and JACKLRING_SLURM_PORT, else the first port Slurm reserved
    for the step (SLURM_STEP_RESV_PORTS, with MpiParams=ports=...), else one derived from the
    job and step ids, so two jobs on one node do not collide."""
    host = expand_hostlist(env["SLURM_STEP_NODELIST"])[0]
    port = config.get("JACKLRING_SLURM_PORT")
    if port is None and env.get("SLURM_STEP_RESV_PORTS"):
        port = int(re.split(r"[-,]", env["SLURM_STEP_RESV_PORTS"])[0])
    if port is None:
        job, step = _int(env, "SLURM_JOB_ID"), _int(env, "SLURM_STEP_ID")
        port = SLURM_PORT_BASE + (job * 1009 + step) % SLURM_PORT_SPAN
    return host, port


def _create_slurm(env: Mapping[str, str], timeout: float | None) -> Backend:
    rank, size = slurm_world(env)
    host, port = slurm_rendezvous(env)
    dist = _torch_distributed("the Slurm rendezvous")
    wait = datetime.timedelta(seconds=config.connect_timeout())
    where = f"{host}:{port} (first node of SLURM_STEP_NODELIST; port from JACKLRING_SLURM_PORT, " \
            f"SLURM_STEP_RESV_PORTS or the job and step ids)"
    source = _store_source(f"the Slurm store at {host}:{port}", True)  # task 0 serves it
    _refuse_joining_at_slot_0(rank, source)
    try:
        address = socket.gethostbyname(host)
        store = dist.TCPStore(address, port, size, rank == 0, wait, wait_for_workers=False, multi_tenant=True)
    except Exception as exc:
        raise DistributedError(f"rank {rank}: Slurm rendezvous at {where}: {exc}") from None
    _stores.append(store)
    # Keys of this step only: a step whose port collides with another step's store (on one node,
    # or JACKLRING_SLURM_PORT set alike) must never count that step's ranks as its own.
    step = f"slurm/{env.get('SLURM_JOB_ID', '-')}.{env['SLURM_STEP_ID']}/"
    return _store_ring(store, rank, size, timeout, f"the Slurm store at {host}:{port}", STORE_PREFIX + step,
                       growth=source)


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded: "n[01-03,7],gpu1" -> n01 n02 n03 n7 gpu1."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", text):
        hosts.extend(_expand_one(item.strip()))
    if not hosts:
        raise ConfigError(f"SLURM_STEP_NODELIST={text!r} lists no host")
    return hosts


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item] if item else []
    head, tail = item[:match.start()], item[match.end():]
    out = []
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ConfigError(f"cannot read the Slurm host list entry {item!r}")
        for n in range(int(low), int(high or low) + 1):
            out.extend(_expand_one(f"{head}{n:0{len(low)}d}{tail}"))
    return out


# ---- shared ----------------------------------------------------------------------------------

def _store_source(where: str, in_rank0: bool):
    from .rendezvous.store_grow import StoreSource

    return StoreSource(where, in_rank0)


def _refuse_joining_at_slot_0(rank: int, source) -> None:
    """A newcomer (JACKLRING_JOIN=1) for slot 0 of a store that rank 0 served: before it would
    start a store server of its own at the dead rank's port and wait there for nobody."""
    from .rendezvous.store_grow import died_with_rank0

    if rank == 0 and source.in_rank0 and config.get("JACKLRING_JOIN"):
        raise ConfigError(f"slot 0: JACKLRING_JOIN=1 with rank 0: {died_with_rank0(source)}")


def _store_ring(store, rank: int, size: int, timeout: float | None, where: str,
                prefix: str = STORE_PREFIX, growth=None) -> Backend:
    """The ring formed through `store` (its keys under `prefix`); growth: store_ring's. A
    process started with JACKLRING_JOIN=1 (a newcomer at a vacant slot) instead waits to be
    taken in by the members' grow() (rendezvous/store_grow.py)."""
    import torch.distributed as dist

    from .rendezvous.store_grow import StoreSource
    from .rendezvous.store_ring import join_store_ring, store_ring

    try:
        # Keys of our own: torch's groups on the same store never see ours, nor we theirs.
        scoped = dist.PrefixStore(prefix, store)
        if config.get("JACKLRING_JOIN"):
            if not isinstance(growth, StoreSource):
                raise ConfigError(f"rank {rank}: JACKLRING_JOIN=1 asks to join a running group, which one formed "
                                  f"through {where} cannot: {growth}")
            return join_store_ring(scoped, rank, size, config.op_timeout(timeout), prefix, growth)
        return store_ring(scoped, rank, size, config.op_timeout(timeout), scope=prefix, growth=growth)
    except DistributedError as exc:
        raise type(exc)(f"{exc} (through {where})") from None


def _torch_distributed(what: str):
    try:
        import torch.distributed as dist
    except ImportError:
        raise ConfigError(f"{what}: forming the group needs torch for its store (pip install torch)") from None
    if not dist.is_available():
        raise ConfigError(f"{what}: forming the group needs torch.distributed, which this torch build lacks")
    return dist


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"{name}={env[name]!r} is not an integer") from None


def _check_rank(rank: int, size: int, rank_var: str, size_var: str) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(f"{rank_var}={rank} is out of range for {size_var}={size}")


_PROBES = {"torch-group": _probe_torch_group, "torchrun": _probe_torchrun, "slurm": _probe_slurm}
_CREATES = {"torch-group": _create_torch_group, "torchrun": _create_torchrun, "slurm": _create_slurm}
