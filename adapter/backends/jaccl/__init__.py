"""The JACCL backend: a mesh (or ring) of direct links over RDMA, or over TCP without a device."""
from .backend import JacclBackend, create, probe

__all__ = ["JacclBackend", "create", "probe"]
