"""Group, init() and backend selection.

Caching follows the spec's "Selecting Backend": the first group created is what every
later init() / init(backend="any") returns; init(backend=NAME) returns that backend's
group, creating it on first use.
"""
from __future__ import annotations

import importlib
import threading

from .backends.base import Backend
from .backends.singleton import SingletonBackend
from .errors import BackendUnavailable, DistributedError

BACKENDS = ("ring", "jaccl", "mpi", "nccl")
# Order init(backend="any") tries: NCCL first when GPUs are visible (spec), then the backends
# configured by an explicit file (JACCL's device matrix, the ring hostfile), then MPI, whose
# environment can be set incidentally by a scheduler that launched a ring job.
ANY_ORDER = ("nccl", "jaccl", "ring", "mpi")


class Group:
    """A set of ranks that communicate; wraps one backend communicator."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def backend_name(self) -> str:
        return self._backend.name

    def rank(self) -> int:
        return self._backend.rank()

    def size(self) -> int:
        return self._backend.size()

    def split(self, color: int, key: int = -1) -> "Group":
        """Ranks passing the same color form a new group, ordered by key (default: their rank)."""
        if key < 0:
            key = self.rank()
        return Group(self._backend.split(int(color), int(key)))

    def __repr__(self) -> str:
        return f"Group(backend={self.backend_name!r}, rank={self.rank()}, size={self.size()})"


_lock = threading.RLock()
_groups: dict[str, Group] = {}
_first: Group | None = None


def _module(name: str):
    return importlib.import_module(f"adapter.backends.{name}")


def _probe(name: str) -> str | None:
    """None when the backend's environment is present, else why it cannot start."""
    try:
        module = _module(name)
    except ImportError as exc:
        return f"cannot import adapter.backends.{name}: {exc}"
    return module.probe()


def is_available(backend: str = "any") -> bool:
    """Whether the named backend (or any backend) can start from this environment."""
    _check_name(backend)
    names = ANY_ORDER if backend == "any" else (backend,)
    return any(_probe(name) is None for name in names)


def _check_name(backend: str) -> None:
    if backend != "any" and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of any, {', '.join(BACKENDS)}")


def _create(name: str, timeout: float | None) -> Group:
    return Group(_module(name).create(timeout=timeout))


def init(strict: bool = False, backend: str = "any", timeout: float | None = None) -> Group:
    """Initialize (once) and return the distributed group.

    backend: "any" tries, in order, nccl, jaccl, ring and mpi, skipping those whose
    environment is absent. A backend whose environment is present but that fails to
    connect raises: silently training alone on every rank would be worse.
    With nothing to start, the result is a group of size 1, unless strict=True, which
    raises naming each backend and why it could not start.
    timeout: per-operation deadline in seconds (default JACKLRING_TIMEOUT, else 300).
    """
    global _first
    _check_name(backend)
    with _lock:
        if backend == "any" and _first is not None:
            return _first
        if backend in _groups:
            return _groups[backend]
        names = ANY_ORDER if backend == "any" else (backend,)
        reasons = []
        for name in names:
            reason = _probe(name)
            if reason is not None:
                reasons.append(f"{name}: {reason}")
                continue
            group = _create(name, timeout)
            _groups[name] = group
            if _first is None:
                _first = group
            return group
        if strict:
            raise BackendUnavailable("no distributed backend could start:\n  " + "\n  ".join(reasons))
        return Group(SingletonBackend())


def default_group(group: Group | None) -> Group:
    """The group an operation runs on: the one given, else init()'s."""
    if group is None:
        return init()
    if not isinstance(group, Group):
        raise DistributedError(f"group must be an adapter.Group, not {type(group).__name__}")
    return group


def _reset_for_tests() -> None:
    """Forget cached groups (tests only; does not close them)."""
    global _first
    with _lock:
        _groups.clear()
        _first = None
