"""JACCL's links: which transport a group uses (RDMA when every rank can, else the TCP mesh,
agreed over the side channel) and connecting it."""
from __future__ import annotations

import json
import logging

from ... import config
from ...errors import BackendUnavailable
from ..transport import auth, mesh_forming, verbs
from ..transport.slots import Transport
from . import config as jaccl_config
from .side_channel import SideChannel

log = logging.getLogger("jacklring.jaccl")

TRANSPORT_ENV = "JACKLRING_JACCL_TRANSPORT"
TRANSPORTS = ("auto", "tcp", "rdma")


def transport_choice() -> str:
    return config.get("JACKLRING_JACCL_TRANSPORT")


def agree_on_transport(cfg: jaccl_config.JacclConfig, choice: str, side: SideChannel) -> str:
    """Every rank reports whether it can use its RDMA devices; all use RDMA or all use TCP."""
    if choice == "tcp":
        reason = f"{TRANSPORT_ENV}=tcp"
    elif not jaccl_config.lists_devices(cfg.devices):
        reason = "MLX_IBV_DEVICES names no RDMA device (every cell is null)"
    else:
        reason = verbs.probe_devices({d for p in cfg.peers() for d in cfg.devices[cfg.rank][p]})
    reasons = [json.loads(b)["no_rdma"] for b in side.all_gather(json.dumps({"no_rdma": reason}).encode())]
    blocked = [(r, why) for r, why in enumerate(reasons) if why is not None]
    if not blocked:
        return "rdma"
    first_rank, first_reason = blocked[0]
    if choice == "rdma":
        raise BackendUnavailable(f"{TRANSPORT_ENV}=rdma but rank {first_rank} cannot use RDMA: {first_reason}")
    if cfg.rank == 0 and choice == "auto":
        log.warning("JACCL: using the TCP mesh transport (rank %d: %s)", first_rank, first_reason)
    return "tcp"


def build_transport(kind: str, rank: int, size: int, peers: list[int], device_row: list[list[str]],
                     host: str, exchange, token: int, deadline: float, job: auth.Auth,
                     watch=None) -> Transport:
    """Connect the transport; calls exchange exactly once on every rank.

    peers: the ranks the topology needs; the TCP mesh connects to every rank regardless."""
    if kind == "rdma":
        return verbs.connect(rank, size, peers, device_row, exchange, deadline)
    # TCP links every pair even in ring mode (the ring algorithms use only the neighbours), so
    # send/recv reach any rank as on every other backend; RDMA ring mode has only its cables.
    everyone = [p for p in range(size) if p != rank]
    return mesh_forming.connect_mesh(rank, size, everyone, host, exchange, token, deadline, job, watch)
