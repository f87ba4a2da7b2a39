"""JACCL's environment: MLX_RANK, MLX_JACCL_COORDINATOR, MLX_IBV_DEVICES (and MLX_JACCL_RING).

Everything is validated here, before any socket or device is opened, so a bad file gives one
clear ConfigError naming the file and the cell instead of a hang or a late connection error.

Mode selection follows MLX: the N x N device matrix says which ranks are cabled together.
A full matrix (every off-diagonal cell set) is a mesh; a matrix with links only between ring
neighbours (i <-> i+1 mod N) is a ring. MLX_JACCL_RING=1 (what `launcher --backend jaccl-ring`
sets) prefers the ring when the matrix allows one; otherwise a mesh is used when possible.
A matrix of nulls (what the launcher writes for local ranks or a hostfile without `rdma`)
describes no cabling at all: every pair may talk over the TCP mesh transport, so it is a mesh
(a ring with MLX_JACCL_RING=1), and RDMA is impossible. A 1 x 1 matrix is a group of one.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ...config import env_rank
from ...errors import ConfigError
from ..transport.tcp import parse_address

MESH = "mesh"
RING = "ring"

# Each cell: the device names (one per cable) linking row rank to column rank; [] = no link.
DeviceMatrix = list[list[list[str]]]

ENV_VARS = ("MLX_RANK", "MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES")


def missing_variables() -> str | None:
    """The reason JACCL cannot start (a missing variable), or None."""
    missing = [name for name in ENV_VARS if not os.environ.get(name)]
    if missing:
        return f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set"
    return None


def parse_devices(text: str, source: str) -> DeviceMatrix:
    """Parse the JSON text of a device matrix; `source` names it in errors."""
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ConfigError(f"{source}: not valid JSON ({exc or 'nested too deeply'})") from None
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{source}: expected a non-empty JSON list of rows (an N x N matrix)")
    size = len(raw)
    matrix: DeviceMatrix = []
    for i, row in enumerate(raw):
        if not isinstance(row, list):
            raise ConfigError(f"{source}: row {i} is {type(row).__name__}, expected a list of {size} cells")
        if len(row) != size:
            raise ConfigError(
                f"{source}: the matrix must be square ({size} x {size}) but row {i} has {len(row)} cells"
            )
        matrix.append([_parse_cell(cell, source, i, j) for j, cell in enumerate(row)])
    for i in range(size):
        if matrix[i][i]:
            raise ConfigError(f"{source}: cell [{i}][{i}] must be null (a rank has no link to itself), "
                              f"got {raw[i][i]!r}")
    return matrix


def _parse_cell(cell, source: str, i: int, j: int) -> list[str]:
    if cell is None:
        return []
    names = [cell] if isinstance(cell, str) else cell
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{source}: cell [{i}][{j}] must be null, a device name or a list of "
                          f"device names, got {cell!r}")
    return list(names)


def is_mesh(matrix: DeviceMatrix) -> bool:
    n = len(matrix)
    return n >= 2 and all(matrix[i][j] for i in range(n) for j in range(n) if i != j)


def ring_neighbours(rank: int, size: int) -> tuple[int, int]:
    """(left, right) of rank on the ring 0 -> 1 -> ... -> size-1 -> 0."""
    return (rank - 1) % size, (rank + 1) % size


def missing_ring_links(matrix: DeviceMatrix) -> list[tuple[int, int]]:
    """Cells a ring needs (i -> i+1 and i -> i-1, wrapping) that are empty."""
    n = len(matrix)
    missing = []
    for i in range(n):
        for j in ring_neighbours(i, n):
            if not matrix[i][j] and (i, j) not in missing:
                missing.append((i, j))
    return missing


def missing_mesh_links(matrix: DeviceMatrix) -> list[tuple[int, int]]:
    n = len(matrix)
    return [(i, j) for i in range(n) for j in range(n) if i != j and not matrix[i][j]]


def lists_devices(matrix: DeviceMatrix) -> bool:
    """Whether any cell names an RDMA device (else only the TCP mesh transport can connect)."""
    return any(cell for row in matrix for cell in row)


def choose_mode(matrix: DeviceMatrix, prefer_ring: bool, source: str) -> str:
    """MESH or RING as MLX chooses; ConfigError naming the missing cells when neither fits."""
    if len(matrix) < 2:
        return MESH  # a group of one: no links needed
    if not lists_devices(matrix):
        return RING if prefer_ring else MESH  # no cabling described: the TCP mesh links every pair
    ring_missing = missing_ring_links(matrix)
    if prefer_ring and not ring_missing:
        return RING
    if is_mesh(matrix):
        return MESH
    if not ring_missing:
        return RING
    wanted = ring_missing if prefer_ring else missing_mesh_links(matrix)
    cells = ", ".join(f"[{i}][{j}]" for i, j in wanted[:8]) + (" ..." if len(wanted) > 8 else "")
    what = "ring (MLX_JACCL_RING is set)" if prefer_ring else "mesh (or a ring)"
    raise ConfigError(f"{source}: the device matrix has no link for a {what}: empty cells {cells}")


@dataclass(frozen=True)
class JacclConfig:
    rank: int
    size: int
    coordinator: tuple[str, int]
    devices: DeviceMatrix
    mode: str
    source: str

    def peers(self) -> list[int]:
        """The ranks this rank connects to directly in its mode."""
        if self.mode == MESH:
            return [p for p in range(self.size) if p != self.rank]
        return sorted(set(ring_neighbours(self.rank, self.size)) - {self.rank})


def load() -> JacclConfig:
    """Read and validate the whole environment; raise ConfigError before any connection."""
    reason = missing_variables()
    if reason is not None:
        raise ConfigError(f"JACCL: {reason}")
    path = os.environ["MLX_IBV_DEVICES"]
    source = f"MLX_IBV_DEVICES={path}"
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read the device file ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not a text file ({exc.reason} at byte {exc.start})") from None
    matrix = parse_devices(text, source)
    try:
        rank = env_rank(len(matrix))
    except ConfigError as exc:
        raise ConfigError(f"{exc}: {source} describes {len(matrix)} ranks") from None
    coordinator = parse_address(os.environ["MLX_JACCL_COORDINATOR"], "MLX_JACCL_COORDINATOR")
    prefer_ring = os.environ.get("MLX_JACCL_RING", "") not in ("", "0")
    mode = choose_mode(matrix, prefer_ring, source)
    return JacclConfig(rank, len(matrix), coordinator, matrix, mode, source)
