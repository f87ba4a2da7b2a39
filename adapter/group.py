"""Group, init() and backend selection.

Caching follows the spec's "Selecting Backend": the first group created is what every
later init() / init(backend="any") returns; init(backend=NAME) returns that backend's
group, creating it on first use.
"""
from __future__ import annotations

import threading
import weakref
from typing import Sequence

from . import engines
from .backends import registry
from .backends.base import Backend
from .backends.elastic import shrinking
from .backends.registry import ANY_ORDER  # noqa: F401  (the backends' order, kept importable here)
from .backends.singleton import SingletonBackend
from .errors import BackendUnavailable, DistributedError, ExcludedError

DEFAULT_SHRINK_TIMEOUT_S = 10.0


class Group:
    """A set of ranks that communicate; wraps one backend communicator."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        # The backend's one-call native all_reduce of numpy arrays, or None (ops' hottest path).
        self.fast: object | None = getattr(backend, "fast", None)
        self._predecessor: Group | None = None  # the group shrink() formed this one from
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

    def shrink(self, exclude: Sequence[int] | None = None, min_size: int | None = None,
               timeout: float | None = None) -> "Group | None":
        """The group of the ranks that are still alive, numbered 0..k-1 in their old order.

        Call it on every surviving rank after an operation failed with PeerError or
        CollectiveTimeout, or on a healthy group with exclude=[ranks] to leave those ranks out
        (planned maintenance; every caller should pass the same list). The survivors agree on
        who is in (docs/faults.md, "Shrinking a group"): an old member is in when it calls
        shrink() and answers within `timeout`; one that is dead, stopped or slower is out.

        Quorum: the new group must hold at least min_size ranks; by default min_size is a strict
        majority of the old members that exclude= does not name, floor((size - len(exclude)) / 2)
        + 1, so two parts of a divided group can never both carry on. A smaller min_size lets a
        minority carry on (and risks two groups that each think they are the job). Too few:
        QuorumError on every rank of that part.

        A rank left out gets ExcludedError (a PeerError) from this call, and this group raises it
        on every later operation: it must not rejoin. A rank named in exclude= returns None
        at once. On the survivors this group is unusable afterwards and says so; it keeps
        answering late shrink() calls of excluded ranks until it is closed (closing the group
        returned closes it too). timeout: how long a survivor waits for a member that neither
        answers nor is proven dead (default 10 s); a dead rank is noticed at once.
        Raises DistributedError on a backend that cannot shrink (all but the ring)."""
        exclude = sorted({int(q) for q in exclude or ()})
        for q in exclude:
            if not 0 <= q < self.size():
                raise ValueError(f"shrink: exclude names rank {q}, but the group has ranks 0..{self.size() - 1}")
        if min_size is not None and min_size < 1:
            raise ValueError(f"shrink: min_size must be at least 1, not {min_size}")
        timeout = DEFAULT_SHRINK_TIMEOUT_S if timeout is None else float(timeout)
        if self._backend.failure.retired:
            self._backend.failure.check()  # shrunk already, or excluded: say so
        if self.rank() in exclude:
            self._backend.failure.retire(ExcludedError(
                f"rank {self.rank()} was excluded from the group by shrink(exclude={exclude}) on this rank"))
            self.close()
            return None
        try:
            backend = self._backend.shrink(exclude, min_size, timeout)
        except ExcludedError as exc:
            self._backend.failure.retire(exc)
            raise
        return self._succeed(Group(backend), "shrunk", "shrink()")

    def grow(self, count: int | None = None, timeout: float | None = None) -> "Group":
        """This group plus `count` newcomers (default: one for each vacant slot of the hostfile,
        back to the size the job started with), as a new Group on every member and newcomer.

        Call it on every member at a point they choose (a collective). A newcomer is a process
        started like the job's ranks with JACKLRING_JOIN=1 and its rank (MLX_RANK of the hostfile
        or of JACCL's device file, or RANK / SLURM_PROCID of a group formed through torchrun's or
        Slurm's store) set to a vacant slot (a rank of the first group that no member holds now,
        such as a dead rank's): its init() waits to be taken in (under a store, it knocks there
        with a MACed record; under JACCL, at MLX_JACCL_COORDINATOR) and returns the grown group
        (docs/faults.md, "Growing a group").
        The members keep their ranks 0..k-1; the newcomers follow in ascending slot order.
        Only a holder of the job key can be taken in (the handshake is mutual).

        timeout: how long rank 0 looks for the newcomers (default 10 s). If fewer than `count`
        answered in time, every member raises CollectiveTimeout naming each vacant slot and why,
        and this group stays usable. On success this group is unusable and says so, and
        init()'s group is replaced. Ring groups formed from MLX_HOSTFILE or through torchrun's or
        Slurm's store, and JACCL groups on the TCP mesh (or groups shrunk or grown from these)
        only: one formed through a torch process group or by split(), one whose store died with
        rank 0, a JACCL group without the job's first rank 0 (which recruits) or on RDMA, and
        other backends raise DistributedError saying why."""
        if count is not None and int(count) < 1:
            raise ValueError(f"grow: count must be at least 1, not {count}")
        timeout = DEFAULT_SHRINK_TIMEOUT_S if timeout is None else float(timeout)
        if self._backend.failure.retired:
            self._backend.failure.check()  # shrunk or grown already: say so
        backend = self._backend.grow(None if count is None else int(count), timeout)
        return self._succeed(Group(backend), "grown", "grow()")

    def _succeed(self, new: "Group", how: str, call: str) -> "Group":
        """Retire this group in favour of `new` (formed from it by shrink or grow), everywhere
        init()'s group is cached too."""
        new._predecessor = self
        self._backend.failure.retire(DistributedError(
            f"rank {self.rank()}: this group was {how} into a group of {new.size()} (this rank is rank "
            f"{new.rank()} there); use the Group {call} returned"))
        with _lock:
            for name, cached in list(_groups.items()):
                if cached is self:
                    _groups[name] = new
            global first
            if first is self:
                first = new  # the operations that default to init()'s group run on the new group
        return new

    def close(self) -> None:
        """Release this group's connections and listeners; later operations on it raise. Safe to
        call twice. After closing the group init() returned, init() forms a new one."""
        _forget(self)
        self._backend.close()
        shrinking.release(self._backend)  # a group of one has no close() of its own that does it
        predecessor, self._predecessor = self._predecessor, None
        if predecessor is not None:
            predecessor.close()  # the group this one was shrunk from (it answered excluded ranks)

    def __repr__(self) -> str:
        return f"Group(backend={self.backend_name!r}, rank={self.rank()}, size={self.size()})"


_lock = threading.RLock()
_groups: dict[str, Group] = {}
# init()'s group once formed (None before): what the operations default to (ops reads it
# without a call on its hottest path).
first: Group | None = None
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
    global first
    registry.check_name(backend)
    with _lock:
        if backend == "any" and first is not None:
            return first
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
            if first is None:
                first = group
            return group
        if strict:
            raise BackendUnavailable("no distributed backend could start:\n  " + "\n  ".join(reasons))
        return Group(SingletonBackend())


def default_group(group: Group | None) -> Group:
    """The group an operation runs on: the one given, else init()'s."""
    if group is None:
        formed = first  # what init() returns once a group exists, without its lock
        return formed if formed is not None else init()
    if not isinstance(group, Group):
        raise DistributedError(f"group must be an adapter.Group, not {type(group).__name__}")
    return group


def _forget(group: Group) -> None:
    global first
    with _lock:
        for name, cached in list(_groups.items()):
            if cached is group:
                del _groups[name]
        if first is group:
            first = None


def shutdown() -> None:
    """Close every group this process created (init()'s and their sub-groups); the next init()
    forms a new group with a fresh identity."""
    global first
    with _lock:
        groups = list(_live)
        _groups.clear()
        first = None
    for group in groups:
        group._backend.close()


def _reset_for_tests() -> None:
    """Forget cached groups (tests only; does not close them)."""
    global first
    with _lock:
        _groups.clear()
        first = None
