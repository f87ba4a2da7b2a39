"""Exceptions raised by jacklring. Every message names the rank and, where one is involved, the peer.

Every DistributedError carries one typed failure record (Failure): who failed, on which link and
how it was observed, in which operation. Backends fill it (with_failure, blaming) where they
observe or relay a failure; readers use failure_of(exc) or culprit_of(exc), never ad-hoc
attributes. exc.culprit, exc.peer and exc.outer_culprit stay as read-only views of the record."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

# How a failure was observed (Failure.how).
LINK = "link"            # a connection to the peer ended or failed
NOTICE = "notice"        # a peer's last word named the rank at fault (relayed verdict)
DEADLINE = "deadline"    # a deadline passed: the rank at fault is the silent one waited for
ABORT = "abort"          # a forming group was given up (a rank died, gave up or holds another layout)
SHARED = "shared memory"  # a rank of a shared segment died or broke it


@dataclass(frozen=True)
class Failure:
    """What went wrong, as a backend observed it. Ranks are by the numbering of the group in which
    it was observed; None (or a negative rank) means unknown."""

    culprit: int | None = None        # the rank at fault
    peer: int | None = None           # the rank on whose link it was observed (the reporter of a verdict)
    how: str = ""                     # LINK, NOTICE, DEADLINE, ABORT, SHARED, or "" when not said
    operation: str = ""               # the operation it failed in (e.g. "all_reduce of 4096 bytes")
    sequence: int | None = None       # that operation's number in its group
    waiting_on: tuple[int, ...] | None = None  # at a stream deadline: the ranks it still waited for
    outer_culprit: int | None = None  # on a leaders' group (local/staged.py): the rank of the whole group

    def suspect(self, default: int | None = -1) -> int | None:
        """The rank to name when a failure must name one: the culprit, else the peer whose link
        failed, else the first rank waited for, else `default`."""
        for rank in (self.culprit, self.peer, self.waiting_on[0] if self.waiting_on else None):
            if rank is not None:
                return rank
        return default


NO_FAILURE = Failure()


class DistributedError(RuntimeError):
    """Base class of every communication failure."""

    failure: Failure = NO_FAILURE  # replaced per instance by with_failure / blaming

    @property
    def culprit(self) -> int | None:
        """The rank at fault (failure.culprit), None when nobody is blamed."""
        return self.failure.culprit

    @property
    def peer(self) -> int | None:
        """The rank on whose link the failure was observed (failure.peer)."""
        return self.failure.peer

    @property
    def outer_culprit(self) -> int | None:
        """On a leaders' group: the rank of the whole group at fault (failure.outer_culprit)."""
        return self.failure.outer_culprit


def failure_of(exc: BaseException | None) -> Failure:
    """exc's failure record (an empty one for an exception that carries none)."""
    found = getattr(exc, "failure", None)
    return found if isinstance(found, Failure) else NO_FAILURE


def with_failure(exc: BaseException, record: Failure | None = None, **fields) -> BaseException:
    """exc with its failure record replaced by `record` (default: its own), with `fields` changed;
    returns exc, for `raise with_failure(...)`. Other exceptions (an OSError on its way up) get
    a record too, so that readers find it in one place."""
    exc.failure = dataclasses.replace(failure_of(exc) if record is None else record, **fields)  # type: ignore[attr-defined]
    return exc


class ConfigError(DistributedError, ValueError):
    """The environment, a hostfile or an argument is malformed."""


class BackendUnavailable(DistributedError):
    """A backend cannot start in this environment (missing variables or libraries)."""


class PeerError(DistributedError, ConnectionError):
    """A peer closed its connection, died or could not be reached."""


class MismatchError(DistributedError):
    """Two ranks issued different collectives (operation, byte count or dtype) at the same step."""


class CollectiveTimeout(DistributedError, TimeoutError):
    """A blocking call did not finish before its deadline."""


class IntegrityError(DistributedError):
    """A message failed its checksum (JACKLRING_VERIFY=1)."""


class ResourceExhausted(DistributedError):
    """The operating system refused a resource (file descriptors, memory, buffers, ports)."""


class ExcludedError(PeerError):
    """This rank was left out of the group a shrink() formed (it was dead, stopped or too slow to
    answer in time, or named in exclude=): it must not rejoin; it stops or starts a new job."""


class QuorumError(DistributedError):
    """shrink() found too few ranks alive to form a group (no more than half of the old group,
    or fewer than min_size): a minority part must not carry on as if it were the job."""


def blaming(exc: BaseException, culprit: int | None, **fields) -> BaseException:
    """`exc` with `culprit` (the rank at fault, by the group's numbering) in its failure record,
    unless it names one or the rank is unknown (None or negative); `fields` (how, operation...)
    are set with it. Returns exc, for `raise blaming(...)`."""
    if culprit is not None and culprit >= 0 and failure_of(exc).culprit is None:
        with_failure(exc, culprit=culprit, **fields)
    return exc


# How a message carries the culprit where only text survives (torch's C++ re-raises the errors
# of DDP's reducer and of futures as RuntimeError with our message and nothing else).
CULPRIT_MARK = "[culprit: rank {}]"
_CULPRIT_MARK = re.compile(r"\[culprit: rank (\d+)\]")


def culprit_of(exc: BaseException | None) -> int | None:
    """The rank a failure blames: its record's culprit, else that of the error it was raised from,
    else the CULPRIT_MARK in its message (errors re-raised by torch); None when nobody is blamed."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        culprit = failure_of(exc).culprit
        if isinstance(culprit, int) and culprit >= 0:
            return culprit
        found = _CULPRIT_MARK.findall(str(exc))
        if found:
            return int(found[-1])
        exc = exc.__cause__ or exc.__context__
    return None
