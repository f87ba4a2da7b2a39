"""The JACCL backend: a mesh (or ring) of direct links over RDMA, or over TCP without a device.

probe() reads the environment alone; the backend module loads when a group is created, since
init(backend="any") probes JACCL before the ring in every process.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import missing_variables as probe

if TYPE_CHECKING:
    from ..base import Backend
    from .backend import JacclBackend

__all__ = ["JacclBackend", "create", "probe"]


def create(timeout: float | None = None) -> "Backend":
    """A connected JACCL group (backend.py)."""
    from .backend import create as create_group

    return create_group(timeout)


def __getattr__(name: str) -> Any:
    if name == "JacclBackend":
        from .backend import JacclBackend

        return JacclBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
