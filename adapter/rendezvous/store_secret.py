"""Which secret a store ring uses when none is configured (docs/security.md).

torch's store has no authentication, so a key handed over through it is only as safe as the
store. Where every rank is on this host, run by this user, a secret in a 0600 file
(transport.local_secret) serves instead, named by the job's public identity:

  the store (or MASTER_ADDR) is on a    its host:port (+ torchrun's run id)
  loopback address
  torchrun with all ranks on this node   the same (LOCAL_WORLD_SIZE == WORLD_SIZE)
  an srun step on one node               SLURM_JOB_ID.SLURM_STEP_ID

An srun step on several nodes has no such secret, and its store's port is public (derived
from the job and step ids): it is refused unless JACKLRING_ALLOW_UNAUTHENTICATED=1 says the
network is trusted. Elsewhere the ring falls back to the key through the store and warns once
when its listeners are reachable from other hosts.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
from typing import Mapping

from .. import config
from ..backends.transport import auth, local_secret
from ..errors import ConfigError

log = logging.getLogger("jacklring.torch")
ENV_OPT_OUT = "JACKLRING_ALLOW_UNAUTHENTICATED"
_warned: set[str] = set()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _slurm_nodes(environ: Mapping[str, str]) -> int | None:
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if environ.get(name, "").strip().isdigit():
            return int(environ[name])
    return None


def single_host_job(environ: Mapping[str, str] = os.environ,
                    store_address: tuple[str, int] | None = None) -> str | None:
    """The public identity of a job whose ranks are all on this host, or None when that is not
    known. store_address: the TCPStore's (host, port) when known (tcp:// sets no MASTER_ADDR).
    Raises ConfigError for an srun step on several nodes (no way to a secret)."""
    addr, port = environ.get("MASTER_ADDR", "").strip(), environ.get("MASTER_PORT", "").strip()
    if store_address is not None and store_address[1] and _is_loopback(store_address[0]):
        addr, port = store_address[0], str(store_address[1])
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    world, local_world = environ.get("WORLD_SIZE"), environ.get("LOCAL_WORLD_SIZE")
    torchrun_one_node = run_id is not None and world is not None and local_world == world
    if addr and port and (_is_loopback(addr) or torchrun_one_node):
        ip = socket.gethostbyname(addr) if _is_loopback(addr) else addr
        return f"torch {ip}:{port} run {run_id or '-'}"
    if environ.get("SLURM_STEP_NODELIST") and environ.get("SLURM_STEP_ID") and environ.get("SLURM_JOB_ID"):
        nodes = _slurm_nodes(environ)
        if nodes == 1:
            return f"slurm {environ['SLURM_JOB_ID']}.{environ['SLURM_STEP_ID']}"
        raise ConfigError(
            f"this srun step spans {nodes or 'several'} nodes and no job secret is set: its rendezvous store "
            f"listens on a port anyone can compute from the job id, so whoever binds it first would become "
            f"rank 0. Set a secret for the job: `export JACKLRING_SECRET=$(python -c 'import secrets; "
            f"print(secrets.token_hex(32))')` before `srun --export=ALL,JACKLRING_SECRET ...`, or "
            f"JACKLRING_SECRET_FILE=<a 0600 file on a shared file system>; or, on a network you trust, "
            f"{ENV_OPT_OUT}=1")
    return None


def derived_secret(environ: Mapping[str, str] = os.environ,
                   store_address: tuple[str, int] | None = None) -> bytes | None:
    """A secret for this job from a 0600 file when every rank shares this host, else None.
    None as well when JACKLRING_ALLOW_UNAUTHENTICATED=1 (the key then goes through the store)."""
    if config.get(ENV_OPT_OUT, environ):
        return None
    job = single_host_job(environ, store_address)
    if job is None:
        return None
    value, path = local_secret.secret_for(job, environ)
    log.debug("jacklring: job secret derived for %s from %s", job, path)
    return value


def warn_store_key(listen_host: str) -> None:
    """Once per listening address: the ring's key goes through the store and its listeners face the network."""
    if config.get(ENV_OPT_OUT) or _is_loopback(listen_host) or listen_host in _warned:
        return
    _warned.add(listen_host)
    log.warning("jacklring: no job secret is set, so the store ring's key travels through torch's store, which "
                "has no authentication: anyone who can reach MASTER_PORT can join the ring listening on %s. "
                "Set JACKLRING_SECRET (or JACKLRING_SECRET_FILE, mode 0600) to the same value on every rank; "
                "on a network you trust, %s=1 silences this", listen_host, ENV_OPT_OUT)


def auth_for_store_ring(store_address: tuple[str, int] | None = None) -> auth.Auth | None:
    """The configured secret's Auth, else a derived one, else None (the key goes through the store)."""
    secret = auth.job_secret()
    if secret is None:
        secret = derived_secret(os.environ, store_address)
    return None if secret is None else auth.auth_from_secret(secret)
