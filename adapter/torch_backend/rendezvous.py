"""Forming the adapter communicator behind a torch "jacklring" process group.

Which backend runs underneath: pg_options (a JacklringOptions, a dict {"backend": ...} or a
string) else JACKLRING_TORCH_BACKEND, else "auto":
  auto  the MPI backend when launched by mpirun, else the ring
  ring  under our launcher (MLX_RANK / MLX_HOSTFILE agreeing with the group's rank and size)
        the launcher's hostfile; otherwise a ring whose addresses are exchanged through the
        c10d store torch hands the creator (torchrun, env://, tcp://, file://)
  mpi, jaccl, nccl, any   that adapter backend from its environment (adapter.init)
Environment-configured backends serve the default group only, and only when their rank and
size agree with torch's; subgroups (new_group, device meshes) always form a store ring.
"""
from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import os
import socket
import zlib
from dataclasses import dataclass

from .. import config
from ..backends import registry
from ..backends.base import Backend
from ..backends.singleton import SingletonBackend
from ..backends.transport import auth, tcp
from ..errors import ConfigError, DistributedError, IntegrityError
from . import store_records, store_secret

log = logging.getLogger("jacklring.torch")

CHOICES = ("auto", "ring", "mpi", "jaccl", "nccl", "any")
ENV_BACKEND = "JACKLRING_TORCH_BACKEND"
ENV_HOST = "JACKLRING_TORCH_HOST"
KEY_PREFIX = "jacklring/addr/"


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
        log.info("jacklring: subgroup of %d ranks uses a store ring (%s serves the default group only)", size, choice)
    return store_ring(store, rank, size, timeout_s, scope=f"pg/{group_id}"), "store"


def _environment_backend(choice: str) -> str | None:
    """The adapter backend to start from the environment, or None for a store ring."""
    if choice == "ring":
        return "ring" if registry.probe("ring") is None else None
    if choice == "auto":
        if registry.probe("mpi") is None:
            return "mpi"
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


# ---- torch's env:// variables from Slurm or MPI ---------------------------------------------

def fill_torch_env(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> dict[str, str]:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from an srun step or an
    MPI launcher when RANK and WORLD_SIZE are both absent, so init_process_group("jacklring")
    (env://, torch's default) works under plain srun or mpirun. Returns what was set; never
    overrides a variable the user set. MASTER_ADDR: the step's first node under Slurm (task 0
    runs there), 127.0.0.1 for an MPI job on one host; a multi-host MPI job needs the user's
    (mpirun -x MASTER_ADDR=<rank 0's host>). MASTER_PORT: derived from the job's identity, so
    every rank agrees without talking."""
    from .. import engines

    if environ.get("RANK") or environ.get("WORLD_SIZE"):
        return {}
    wanted = _slurm_torch_env(environ, engines) or _mpi_torch_env(environ, engines)
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


# ---- store ring -------------------------------------------------------------------------------

def store_ring(store, rank: int, size: int, timeout_s: float, scope: str = "") -> Backend:
    """Every rank listens on a free port, publishes ip:port in the store, reads everyone's.

    Each rank's record is MACed under the job key and bound to its key name, so a value an
    outsider wrote is reported as tampering (store_records). The ring's connections prove the
    job secret (JACKLRING_SECRET / _FILE) when one is set; otherwise rank 0 of the group draws
    a random key and hands it over through the store, so the store is the trust root: whoever
    can read it can join (docs/security.md). scope names the group on this store (the same on
    every member); the formation's keys are tagged without any counter in the store."""
    from ..backends.ring.backend import RingBackend
    from ..config import connect_timeout

    host = listen_host(store)
    listener = tcp.Listener(host, 0)  # TCP, plus a Unix socket that same-host peers use
    try:
        mine = tcp.format_address(listener.getsockname()[:2])
        # A store can outlive a group (torch keeps one TCPStore server per port in a process and
        # names the groups of a new init like the old ones; torchrun's agent keeps its store over
        # restarts), so every formation's keys carry a tag every rank derives on its own.
        tag = store_records.formation_tag(f"{scope}/{size}")
        prefix = f"{KEY_PREFIX}{tag}/"
        wait_s = min(timeout_s, connect_timeout())
        try:
            job = store_auth(store, prefix, rank, wait_s, host)
            book = store_records.RecordBook(store, prefix, job, rank, size)
            records = book.gather(book.publish(mine), wait_s)
        except (DistributedError, ConfigError):
            raise
        except Exception as exc:  # the store itself is gone (its server's process ended)
            raise DistributedError(f"rank {rank}: jacklring rendezvous: the store closed while this rank "
                                   f"waited for every rank's address ({exc})") from None
        addresses = [[r.address] for r in records]
        log.info("rank %d: jacklring ring addresses %s (formation %s)", rank, addresses, tag)
        return RingBackend(rank, addresses, [listener], timeout_s, wait_s, job=job)
    except BaseException:
        listener.close()
        raise


def store_auth(store, prefix: str, rank: int, wait_s: float = 120.0, listen_host: str = "127.0.0.1") -> auth.Auth:
    """The job secret when configured, else one derived from a 0600 file when every rank shares
    this host (store_secret), else a random key drawn by rank 0 and shared through the store
    (which every rank has already trusted with the rendezvous; a warning says so once when the
    ring listens beyond loopback)."""
    job = store_secret.auth_for_store_ring(store_address(store))
    if job is not None:
        return job
    if config.get("JACKLRING_REQUIRE_AUTH"):
        raise ConfigError("JACKLRING_REQUIRE_AUTH=1 but no job secret is set: a key shared through torch's "
                          "store is only as safe as the store (which has no authentication); set "
                          "JACKLRING_SECRET or JACKLRING_SECRET_FILE on every rank")
    store_secret.warn_store_key(listen_host)
    key = f"{prefix}key"
    if rank == 0:
        store.set(key, auth.generate_secret())
    text = store_records.wait_for(store, key, wait_s, rank, "group key from rank 0")
    try:
        value = bytes.fromhex(text.decode())
    except ValueError:
        value = b""
    if len(value) != auth.SECRET_BYTES:
        raise IntegrityError(f"rank {rank}: jacklring rendezvous: the store value at key {key!r} (rank 0's "
                             f"group key) was tampered with: not {auth.SECRET_BYTES} bytes of hex")
    return auth.auth_from_secret(value)


def listen_host(store) -> str:
    """JACKLRING_TORCH_HOST, else 127.0.0.1 when the rendezvous host is loopback, else the local
    address this machine uses to reach the rendezvous host."""
    explicit = config.get(ENV_HOST)
    if explicit:
        return explicit
    master = _rendezvous_host(store)
    if master is None:
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(master, None, socket.AF_INET, socket.SOCK_STREAM)
        ip = infos[0][4][0]
    except OSError:
        return "127.0.0.1"
    if ipaddress.ip_address(ip).is_loopback:
        return "127.0.0.1"
    # Connecting a UDP socket sends nothing; it only asks the kernel for the route's source address.
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((ip, 9))
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def _rendezvous_host(store) -> str | None:
    address = store_address(store)
    return address[0] if address is not None else (os.environ.get("MASTER_ADDR") or None)


def store_address(store) -> tuple[str, int] | None:
    """(host, port) of the TCPStore under any PrefixStores, or None (a FileStore, HashStore)."""
    seen = 0
    while store is not None and seen < 16:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            port = getattr(store, "port", None)
            return host, int(port) if isinstance(port, int) else 0
        store = getattr(store, "underlying_store", None)
        seen += 1
    return None


def deadline_seconds(timeout: object) -> float:
    if timeout is None:
        from ..config import op_timeout

        return op_timeout()
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if not seconds > 0:
        raise ConfigError(f"jacklring: timeout {timeout!r} must be positive")
    return seconds

