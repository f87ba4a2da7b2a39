"""torch's env:// variables from the MLX contract, for scripts started by `mlx.launch`.

mlx.launch sets MLX_RANK and, per backend, MLX_HOSTFILE (ring), MLX_JACCL_COORDINATOR with
MLX_IBV_DEVICES (JACCL) or MLX_WORLD_SIZE with NCCL_HOST_IP (NCCL), but none of RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, which init_process_group's env:// reads. They follow
from what every rank already shares: the rank, the group's size (the hostfile's or the device
matrix's length), rank 0's host (the hostfile's first address, the coordinator's or NCCL's
host), and a port derived from the job's own description, so every rank agrees without talking.
"""
from __future__ import annotations

import json
import zlib
from typing import Mapping

PORT_BASE = 20000
PORT_SPAN = 12000  # below mlx.launch's default ports (32323 up) and Linux's ephemeral range


def mlx_torch_env(environ: Mapping[str, str]) -> dict[str, str]:
    """RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the MLX variables, or {}
    when they are absent or unreadable (the backend reports those when it forms)."""
    rank = environ.get("MLX_RANK", "")
    if not rank.isdigit():
        return {}
    found = _ring(environ) or _jaccl(environ) or _nccl(environ)
    if found is None:
        return {}
    size, host, identity, taken = found
    if not 0 <= int(rank) < size:
        return {}
    port = PORT_BASE + zlib.crc32(identity.encode()) % PORT_SPAN
    while port in taken:  # never one of the ports the job's backend listens on
        port += 1
    # No LOCAL_RANK: mlx.launch does not say which ranks share a host, and init needs none.
    return {"RANK": rank, "WORLD_SIZE": str(size), "MASTER_ADDR": host, "MASTER_PORT": str(port)}


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _ring(environ: Mapping[str, str]):
    hosts = _read_json(environ["MLX_HOSTFILE"]) if environ.get("MLX_HOSTFILE") else None
    if not (isinstance(hosts, list) and hosts and all(isinstance(h, list) and h for h in hosts)):
        return None
    try:
        addresses = [_split(str(a)) for h in hosts for a in h]
    except ValueError:
        return None
    return len(hosts), addresses[0][0], json.dumps(hosts), {p for _, p in addresses}


def _jaccl(environ: Mapping[str, str]):
    coordinator, devices = environ.get("MLX_JACCL_COORDINATOR"), environ.get("MLX_IBV_DEVICES")
    matrix = _read_json(devices) if coordinator and devices else None
    if not (isinstance(matrix, list) and matrix):
        return None
    try:
        host, port = _split(coordinator)
    except ValueError:
        return None
    return len(matrix), host, coordinator + json.dumps(matrix), {port}


def _nccl(environ: Mapping[str, str]):
    size, host, port = environ.get("MLX_WORLD_SIZE", ""), environ.get("NCCL_HOST_IP"), environ.get("NCCL_PORT", "")
    if not (size.isdigit() and host and port.isdigit()):
        return None
    return int(size), host, f"{host}:{port}/{size}", {int(port)}
