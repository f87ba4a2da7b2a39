"""The ring backend: MLX's ring over TCP (or same-host Unix sockets), any group size."""
from .backend import RingBackend, create, probe

__all__ = ["RingBackend", "create", "probe"]
