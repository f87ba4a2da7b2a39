"""What each rank's environment holds, per backend (the contract in docs/environment.md).

Pure planning: no process is started here. Files (MLX_HOSTFILE, MLX_IBV_DEVICES) are
returned as contents; whoever starts the rank writes them on the rank's own host.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from jacklring_shared import ports as port_choice
from jacklring_shared.secret_file import read_secret_file
from jacklring_shared.secret_text import decode_secret, drawn_secret_text

from .hostfile import Host

DEFAULT_STARTING_PORT = 32323   # mlx.launch's default
DEFAULT_NCCL_PORT = 12345       # mlx.launch's default
DEFAULT_MASTER_PORT = 29500     # torchrun's default, used when rank 0 is remote


@dataclass
class LaunchOptions:
    backend: str
    envs: list[str] = field(default_factory=list)        # hostfile envs then --env, "K=V"
    starting_port: Optional[int] = None
    connections_per_ip: int = 1
    nccl_port: Optional[int] = None
    verbose: bool = False
    columns: Optional[tuple[int, int]] = None             # terminal (cols, lines) to pass on
    secret: Optional[str] = None                          # JACKLRING_SECRET for every rank (job_secret())


@dataclass
class RankPlan:
    rank: int
    host: Host
    local_rank: int
    local_world_size: int
    env: dict[str, str]                                   # set on top of the rank's environment
    files: dict[str, str] = field(default_factory=dict)   # variable -> file content


def plan_ranks(hosts: list[Host], options: LaunchOptions) -> list[RankPlan]:
    """One plan per rank: torch variables < user envs < the backend's contract variables."""
    all_local = all(h.is_local for h in hosts)
    shared_env, files = _backend_contract(hosts, options, all_local)
    torch_env = _torch_env(hosts, all_local)
    if options.backend in ("jaccl", "jaccl-ring") and "JACKLRING_TORCH_BACKEND" not in os.environ:
        # The torch process group runs where the job's backend does (--env can still say otherwise).
        torch_env["JACKLRING_TORCH_BACKEND"] = "jaccl"
    verbose_env = _verbose_env(options)
    per_host = Counter(h.ssh for h in hosts)
    seen: Counter = Counter()
    plans = []
    for rank, host in enumerate(hosts):
        local_rank = seen[host.ssh]
        seen[host.ssh] += 1
        env = {
            "PYTHONUNBUFFERED": "1",  # ranks write into pipes: keep lines timely and ordered
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(per_host[host.ssh]),
            **torch_env,
        }
        if options.columns:
            env["COLUMNS"], env["LINES"] = map(str, options.columns)
        env.update(verbose_env)
        threads = default_threads(host, per_host[host.ssh], options)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        env.update(parse_env_assignments(options.envs))
        env.update(shared_env)
        for name in files:
            env.pop(name, None)  # points at the file written on the rank's host
        env["MLX_RANK"] = str(rank)
        if options.secret:
            # Handed over in the rank's environment (local ranks), the agent's stdin (ssh) or
            # mpirun's environment (-x NAME): never on a command line.
            env[SECRET_ENV] = options.secret
        if options.backend == "nccl":
            env["CUDA_VISIBLE_DEVICES"] = str(local_rank)
        plans.append(RankPlan(rank, host, local_rank, per_host[host.ssh], env, dict(files)))
    return plans


SECRET_ENV = "JACKLRING_SECRET"
SECRET_FILE_ENV = "JACKLRING_SECRET_FILE"


def job_secret(user_env: dict[str, str], environ: Optional[dict[str, str]] = None) -> str:
    """The job secret every rank gets: the user's JACKLRING_SECRET (--env / hostfile envs,
    else this environment), else the contents of their JACKLRING_SECRET_FILE, else 256 fresh
    random bits. Ranks then prove it to each other on every connection (docs/security.md).
    SecretFileError / WeakSecretError for a file or a secret a rank would refuse (e.g. a file
    readable by others, a guessable passphrase)."""
    environ = os.environ if environ is None else environ
    # The ranks' own checks: a file or a passphrase they would refuse fails here, before any starts.
    for source in (user_env, environ):
        if source.get(SECRET_ENV, "").strip():
            decode_secret(source[SECRET_ENV], SECRET_ENV)
            return source[SECRET_ENV].strip()
    for source in (user_env, environ):
        path = source.get(SECRET_FILE_ENV, "").strip()
        if path:
            text = read_secret_file(path)
            if text:
                decode_secret(text, f"{SECRET_FILE_ENV}={path!r}")
                return text
    return drawn_secret_text()  # 256 random bits, marked so the ranks need not stretch them


def default_threads(host: Host, ranks_on_host: int, options: LaunchOptions) -> Optional[int]:
    """OMP_NUM_THREADS for a rank unless the user chose it: the host's cores shared among its
    ranks (at least 1), so torch's intra-op threads of several ranks do not fight over the
    same cores. A remote host's core count is unknown here: 1 when it runs several ranks
    (torchrun's default), unset when it runs one."""
    if "OMP_NUM_THREADS" in parse_env_assignments(options.envs) or "OMP_NUM_THREADS" in os.environ:
        return None
    if host.is_local:
        return max(1, local_cores() // ranks_on_host)
    return 1 if ranks_on_host > 1 else None


def local_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_notice(plans: list[RankPlan], options: LaunchOptions) -> Optional[str]:
    """The one line the launcher prints when it chose OMP_NUM_THREADS (torchrun prints one too)."""
    chosen = sorted({p.env["OMP_NUM_THREADS"] for p in plans if "OMP_NUM_THREADS" in p.env})
    user_set = "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in parse_env_assignments(options.envs)
    if not chosen or user_set:
        return None
    local = [p for p in plans if p.host.is_local]
    basis = (f" ({local_cores()} cores / {local[0].local_world_size} local ranks)" if local else "")
    return (f"setting OMP_NUM_THREADS={','.join(chosen)} for each rank{basis} so ranks do not "
            f"oversubscribe the CPUs; set OMP_NUM_THREADS (environment or --env) to choose")


def _verbose_env(options: LaunchOptions) -> dict[str, str]:
    """--verbose's logging switches: defaults that --env may still change."""
    if not options.verbose:
        return {}
    if options.backend == "ring":
        return {"MLX_RING_VERBOSE": "1"}
    if options.backend == "nccl":
        return {"NCCL_DEBUG": "INFO"}
    return {}


def ignored_assignments(plans: list[RankPlan], items: list[str]) -> list[str]:
    """The user's variables that the backend contract replaces (MLX_RANK, MLX_HOSTFILE,
    NCCL_PORT, ...): a rank must agree with its peers on these, so they cannot be set."""
    wanted = parse_env_assignments(items)
    return [key for key in wanted
            if any(key in p.files or p.env.get(key) != wanted[key] for p in plans)]


def parse_env_assignments(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = value
    return out


def _torch_env(hosts: list[Host], all_local: bool) -> dict[str, str]:
    master = hosts[0].address
    port = free_ports([master])[0] if hosts[0].is_local else DEFAULT_MASTER_PORT
    return {"WORLD_SIZE": str(len(hosts)), "MASTER_ADDR": master, "MASTER_PORT": str(port)}


def _backend_contract(hosts: list[Host], options: LaunchOptions, all_local: bool):
    """(variables shared by every rank, files shared by every rank) for options.backend."""
    backend = options.backend
    if backend == "ring":
        addresses = ring_addresses(hosts, options.connections_per_ip, options.starting_port, all_local)
        return {}, {"MLX_HOSTFILE": json.dumps(addresses)}
    if backend in ("jaccl", "jaccl-ring"):
        coordinator = hosts[0].ips[0]
        port = options.starting_port or (
            free_ports([coordinator])[0] if all_local else DEFAULT_STARTING_PORT)
        env = {"MLX_JACCL_COORDINATOR": f"{_host_port(coordinator, port)}"}
        if backend == "jaccl-ring":
            env["MLX_JACCL_RING"] = "1"  # what mlx.launch sets for --backend jaccl-ring
        return env, {"MLX_IBV_DEVICES": json.dumps(rdma_matrix(hosts))}
    if backend == "nccl":
        ip = hosts[0].ips[0]
        port = options.nccl_port or (free_ports([ip])[0] if all_local else DEFAULT_NCCL_PORT)
        env = {"NCCL_HOST_IP": ip, "NCCL_PORT": str(port), "MLX_WORLD_SIZE": str(len(hosts))}
        return env, {}
    if backend == "mpi":
        return {}, {}  # mpirun provides ranks; see launcher/mpi.py
    raise ValueError(f"unknown backend {backend!r}")


def ring_addresses(hosts: list[Host], connections_per_ip: int,
                   starting_port: Optional[int], all_local: bool) -> list[list[str]]:
    """Per rank: each of its ips x connections_per_ip, on consecutive ports from
    starting_port (mlx.launch's layout). An all-local run without --starting-port takes
    free ports instead, so two jobs on one machine do not collide."""
    wanted = [ip for h in hosts for ip in h.ips for _ in range(connections_per_ip)]
    if starting_port is None and all_local:
        ports = free_ports(wanted)
    else:
        start = starting_port or DEFAULT_STARTING_PORT
        ports = list(range(start, start + len(wanted)))
    it = iter(zip(wanted, ports))
    return [[_host_port(*next(it)) for _ in h.ips for _ in range(connections_per_ip)]
            for h in hosts]


def rdma_matrix(hosts: list[Host]) -> list[list]:
    """The hosts' rdma rows; hosts without any rdma get an all-null N x N matrix."""
    n = len(hosts)
    if not any(h.rdma for h in hosts):
        return [[None] * n for _ in range(n)]
    return [list(h.rdma) for h in hosts]


def free_ports(addresses: list[str]) -> list[int]:
    """One currently free TCP port per address, all distinct, below the ephemeral range (see
    jacklring_shared.ports: a port from that range can be taken by any outgoing connection
    before the rank binds it)."""
    return port_choice.free_ports(addresses)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
