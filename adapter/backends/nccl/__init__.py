"""The NCCL backend: CUDA buffers reduced on the GPU through NCCL, bootstrapped over TCP."""
from .backend import NcclBackend, create, probe

__all__ = ["NcclBackend", "create", "probe"]
