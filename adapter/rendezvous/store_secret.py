"""Which secret a store ring uses when none is configured (docs/security.md).

torch's store has no authentication, so a key handed over through it is only as safe as the
store. Where every rank is on this host, run by this user, a secret in a 0600 file
(transport.local_secret) serves instead, named by the job's public identity:

  the store (or MASTER_ADDR) is on a    its host:port (+ torchrun's run id)
  loopback address
  torchrun with all ranks on this node   the same (LOCAL_WORLD_SIZE == WORLD_SIZE)
  an srun step on one node               SLURM_JOB_ID.SLURM_STEP_ID

A group that spans hosts has no such secret, and its listeners (and store) face the network:
without a configured secret it is refused, unless JACKLRING_ALLOW_UNAUTHENTICATED=1 says the
network is trusted (the key then goes through the store). It spans hosts when the engine's
variables say so (LOCAL_WORLD_SIZE < WORLD_SIZE, GROUP_WORLD_SIZE / NNODES > 1, a node rank
above 0, an srun step on several nodes; these win over a loopback MASTER_ADDR, which a host
name can resolve to on its own node) or, with no single-host identity, when the ring would
listen beyond loopback. A wrong guess of "one host" fails closed: ranks on another host derive
another file's secret and the handshake refuses them.
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
HOW_TO_SET = ("Set the same job secret on every rank: `export JACKLRING_SECRET=$(python -c 'import secrets; "
              "print(secrets.token_hex(32))')` where the job starts, forwarded to every host (srun "
              "--export=ALL,JACKLRING_SECRET, mpirun -x JACKLRING_SECRET, a Kubernetes Secret, Ray's "
              "runtime_env; docs/launching.md), or JACKLRING_SECRET_FILE=<a 0600 file every host can read>; "
              f"or, on a network you trust, {ENV_OPT_OUT}=1 (the key then travels through the store)")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _count(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


def _slurm_nodes(environ: Mapping[str, str]) -> int | None:
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if _count(environ, name) is not None:
            return _count(environ, name)
    return None


def _slurm_step(environ: Mapping[str, str]) -> bool:
    return all(environ.get(n) for n in ("SLURM_STEP_NODELIST", "SLURM_STEP_ID", "SLURM_JOB_ID"))


def hosts_evidence(environ: Mapping[str, str] = os.environ) -> str | None:
    """What in the engine's variables says the job's ranks are on several hosts, or None."""
    world, local_world = _count(environ, "WORLD_SIZE"), _count(environ, "LOCAL_WORLD_SIZE")
    if world is not None and local_world is not None and local_world < world:
        return f"LOCAL_WORLD_SIZE={local_world} < WORLD_SIZE={world}"
    for name in ("GROUP_WORLD_SIZE", "NNODES"):  # torchrun's number of nodes (agents); others'
        if (_count(environ, name) or 0) > 1:
            return f"{name}={environ[name].strip()}"
    for name in ("GROUP_RANK", "NODE_RANK"):
        if (_count(environ, name) or 0) > 0:
            return f"{name}={environ[name].strip()} (not the first node)"
    one_node_by_torch = world is not None and local_world == world
    if _slurm_step(environ) and not one_node_by_torch and (_slurm_nodes(environ) or 1) > 1:
        return f"this srun step spans {_slurm_nodes(environ)} nodes"  # unknown: decided below, after the store
    return None


def single_host_job(environ: Mapping[str, str] = os.environ,
                    store_address: tuple[str, int] | None = None) -> str | None:
    """The public identity of a job whose ranks are all on this host, or None when that is not
    known. store_address: the TCPStore's (host, port) when known (tcp:// sets no MASTER_ADDR).
    Raises ConfigError when the engine's variables say the job spans hosts (no file serves)."""
    evidence = hosts_evidence(environ)
    if evidence is not None:
        raise _refusal(evidence)
    addr, port = environ.get("MASTER_ADDR", "").strip(), environ.get("MASTER_PORT", "").strip()
    if store_address is not None and store_address[1] and _is_loopback(store_address[0]):
        addr, port = store_address[0], str(store_address[1])
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    world, local_world = environ.get("WORLD_SIZE"), environ.get("LOCAL_WORLD_SIZE")
    torchrun_one_node = run_id is not None and world is not None and local_world == world
    if addr and port and (_is_loopback(addr) or torchrun_one_node):
        ip = socket.gethostbyname(addr) if _is_loopback(addr) else addr
        return f"torch {ip}:{port} run {run_id or '-'}"
    if _slurm_step(environ):
        if _slurm_nodes(environ) == 1:
            return f"slurm {environ['SLURM_JOB_ID']}.{environ['SLURM_STEP_ID']}"
        raise _refusal("this srun step spans several nodes: Slurm does not say how many")
    return None


def _refusal(why: str) -> ConfigError:
    return ConfigError(
        f"jacklring: no job secret is set and this group spans hosts ({why}): its rendezvous store "
        f"(torch's TCPStore, no authentication) and its ring's listeners are reachable from other hosts, so a "
        f"key handed over through the store would let anyone who reaches MASTER_PORT join the ring, and a "
        f"store whose port anyone can compute can be bound first by someone else. {HOW_TO_SET}")


def derived_secret(environ: Mapping[str, str] = os.environ,
                   store_address: tuple[str, int] | None = None,
                   listen_host: str = "127.0.0.1") -> bytes | None:
    """A secret for this job from a 0600 file when every rank shares this host; None when the
    ring listens on loopback only and no identity is known, or under JACKLRING_ALLOW_UNAUTHENTICATED=1
    (the key then goes through the store). Raises ConfigError for a group that spans hosts."""
    if config.get(ENV_OPT_OUT, environ):
        return None
    job = single_host_job(environ, store_address)
    if job is None:
        if not _is_loopback(listen_host):
            raise _refusal(f"its ring listens on {listen_host}, beyond loopback, and nothing says every rank "
                           f"is on this host (MASTER_ADDR is not a loopback address, no LOCAL_WORLD_SIZE == "
                           f"WORLD_SIZE)")
        return None
    value, path = local_secret.secret_for(job, environ)
    log.debug("jacklring: job secret derived for %s from %s", job, path)
    return value


def ring_salt(store_address: tuple[str, int] | None, environ: Mapping[str, str] = os.environ) -> bytes:
    """What salts a store ring's key: the store's address and the run (torchrun's run id), the
    facts every rank and newcomer of the job shares. A table of keys computed once for a list
    of guessed passphrases then serves one store and run, not every store-ring job."""
    where = f"{store_address[0]}:{store_address[1]}" if store_address is not None else "-"
    return f"store-ring {where} run {environ.get('TORCHELASTIC_RUN_ID', '-')}".encode()


def auth_for_store_ring(store_address: tuple[str, int] | None = None,
                        listen_host: str = "127.0.0.1") -> auth.Auth | None:
    """The configured secret's Auth, else a derived one, else None (the key goes through the
    store: listeners on loopback only, or the opt-out). ConfigError for a group spanning hosts."""
    salt = ring_salt(store_address)
    secret = auth.configured_secret()
    if secret is not None:
        return auth.auth_from_secret(secret.value, salt, drawn=secret.drawn)
    derived = derived_secret(os.environ, store_address, listen_host)  # 256 bits drawn by local_secret
    return None if derived is None else auth.auth_from_secret(derived, salt, drawn=True)
