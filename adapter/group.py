"""Group, init() and backend selection.

Caching follows the spec's "Selecting Backend": the first group created is what every
later init() / init(backend="any") returns; init(backend=NAME) returns that backend's
group, creating it on first use.
"""
from __future__ import annotations

import threading
import weakref

from . import engines
from .backends import registry
from .backends.base import Backend
from .backends.registry import ANY_ORDER  # noqa: F401  (the backends' order, kept importable here)
from .backends.singleton import SingletonBackend
from .errors import BackendUnavailable, DistributedError


class Group:
    """A set of ranks that communicate; wraps one backend communicator."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        _live.add(self)

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

    def close(self) -> None:
        """Release this group's connections and listeners; later operations on it raise. Safe to
        call twice. After closing the group init() returned, init() forms a new one."""
        _forget(self)
        self._backend.close()

    def __repr__(self) -> str:
        return f"Group(backend={self.backend_name!r}, rank={self.rank()}, size={self.size()})"


_lock = threading.RLock()
_groups: dict[str, Group] = {}
_first: Group | None = None
# Every group not yet garbage-collected, so shutdown() can close sub-groups too.
_live: "weakref.WeakSet[Group]" = weakref.WeakSet()


def is_available(backend: str = "any") -> bool:
    """Whether the named backend (or any backend) can start from this environment."""
    registry.check_name(backend)
    names = engines.SOURCES if backend == "any" else (backend,)
    return any(_present(name) for name in names)


def _present(source: str) -> bool:
    try:
        return engines.probe(source) is None
    except DistributedError:
        return True  # a malformed variable is present: init() reports it


def init(strict: bool = False, backend: str = "any", timeout: float | None = None) -> Group:
    """Initialize (once) and return the distributed group.

    backend: "any" forms the group from whatever started the process, trying in order
    (adapter.engines.SOURCES): the MLX variables of nccl, jaccl and ring (our launcher), an
    existing torch process group, torchrun-style RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT,
    an srun step, mpirun. A source whose environment is present but that fails to connect
    raises: silently training alone on every rank would be worse.
    With nothing to start, the result is a group of size 1, unless strict=True, which
    raises naming each source and why it could not start.
    timeout: per-operation deadline in seconds (default JACKLRING_TIMEOUT, else 300).
    """
    global _first
    registry.check_name(backend)
    with _lock:
        if backend == "any" and _first is not None:
            return _first
        if backend in _groups:
            return _groups[backend]
        names = engines.SOURCES if backend == "any" else (backend,)
        reasons = []
        for name in names:
            reason = engines.probe(name)
            if reason is not None:
                reasons.append(f"{name}: {reason}")
                continue
            group = Group(engines.create(name, timeout))
            if name in registry.BACKENDS:
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
        first = _first  # what init() returns once a group exists, without its lock
        return first if first is not None else init()
    if not isinstance(group, Group):
        raise DistributedError(f"group must be an adapter.Group, not {type(group).__name__}")
    return group


def _forget(group: Group) -> None:
    global _first
    with _lock:
        for name, cached in list(_groups.items()):
            if cached is group:
                del _groups[name]
        if _first is group:
            _first = None


def shutdown() -> None:
    """Close every group this process created (init()'s and their sub-groups); the next init()
    forms a new group with a fresh identity."""
    global _first
    with _lock:
        groups = list(_live)
        _groups.clear()
        _first = None
    for group in groups:
        group._backend.close()


def _reset_for_tests() -> None:
    """Forget cached groups (tests only; does not close them)."""
    global _first
    with _lock:
        _groups.clear()
        _first = None
