"""Settings read from the environment, parsed in one place so every backend reports bad values alike."""
from __future__ import annotations

import math
import os

from .errors import ConfigError

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_CONNECT_TIMEOUT_S = 120.0
# Sockets and poll() overflow past a few weeks; a longer deadline is a typo, not a plan.
MAX_SECONDS = 1e6


def check_seconds(value: float, what: str) -> float:
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise ConfigError(f"{what} must be a number of seconds in (0, {MAX_SECONDS:.0f}]")
    return value


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None
    return check_seconds(value, f"{name}={raw!r}")


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def env_rank(world_size: int | None = None) -> int:
    """MLX_RANK as an int, checked against the world size when one is known."""
    raw = os.environ.get("MLX_RANK")
    if raw is None:
        raise ConfigError("MLX_RANK is not set")
    try:
        rank = int(raw)
    except ValueError:
        raise ConfigError(f"MLX_RANK={raw!r} is not an integer") from None
    if rank < 0 or (world_size is not None and rank >= world_size):
        bound = f" (world size {world_size})" if world_size is not None else ""
        raise ConfigError(f"MLX_RANK={rank} is out of range{bound}")
    return rank


def op_timeout(explicit: float | None = None) -> float:
    """Per-operation deadline: the init() argument, else JACKLRING_TIMEOUT, else 300 s."""
    if explicit is not None:
        return check_seconds(float(explicit), f"timeout={explicit!r}")
    return env_float("JACKLRING_TIMEOUT", DEFAULT_TIMEOUT_S)


def connect_timeout(explicit: float | None = None) -> float:
    """Deadline for forming the group: JACKLRING_CONNECT_TIMEOUT, else 120 s."""
    if explicit is not None:
        return check_seconds(float(explicit), f"connect_timeout={explicit!r}")
    return env_float("JACKLRING_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT_S)
