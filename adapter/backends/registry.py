"""Which backends exist, the order init(backend="any") tries them, and probe/create by name.

Each backend is a package under adapter/backends/ exposing probe() (None when its environment
is present, else why it cannot start; never raises) and create(timeout) (a connected Backend).
Adding a backend means adding its package and its name here.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import DistributedError
from .base import Backend

BACKENDS = ("ring", "jaccl", "mpi", "nccl")
# Order init(backend="any") tries: NCCL first when GPUs are visible (spec), then the backends
# configured by an explicit file (JACCL's device matrix, the ring hostfile), then MPI, whose
# environment can be set incidentally by a scheduler that launched a ring job.
ANY_ORDER = ("nccl", "jaccl", "ring", "mpi")


def check_name(name: str, allow_any: bool = True) -> None:
    if (allow_any and name == "any") or name in BACKENDS:
        return
    choices = ("any",) + BACKENDS if allow_any else BACKENDS
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(choices)}")


def _module(name: str) -> ModuleType:
    check_name(name, allow_any=False)
    return importlib.import_module(f"{__package__}.{name}")


def probe(name: str) -> str | None:
    """None when the backend's environment is present, else why it cannot start. Never raises
    for a missing library or a malformed setting: those are reasons, reported by create()."""
    try:
        module = _module(name)
    except ImportError as exc:
        return f"cannot import adapter.backends.{name}: {exc}"
    try:
        return module.probe()
    except DistributedError as exc:
        return str(exc)


def create(name: str, timeout: float | None = None) -> Backend:
    """A connected communicator of the named backend (raises when it cannot form)."""
    return _module(name).create(timeout=timeout)
