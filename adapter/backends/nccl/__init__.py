"""The NCCL backend: CUDA buffers reduced on the GPU through NCCL, bootstrapped over TCP.

probe() reads the environment alone; the backend module loads when a group is created, since
init(backend="any") probes NCCL first in every process.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .environment import probe

if TYPE_CHECKING:
    from .backend import NcclBackend

__all__ = ["NcclBackend", "create", "probe"]


def create(timeout: float | None = None) -> "NcclBackend":
    """A connected NCCL group (backend.py)."""
    from .backend import create as create_group

    return create_group(timeout)


def __getattr__(name: str) -> Any:
    if name == "NcclBackend":
        from .backend import NcclBackend

        return NcclBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
