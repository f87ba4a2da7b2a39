"""The MPI backend: collectives through mpi4py when the job was started by mpirun."""
from .backend import MPIBackend, create, probe

__all__ = ["MPIBackend", "create", "probe"]
