"""Exceptions raised by jacklring. Every message names the rank and, where one is involved, the peer."""
import re


class DistributedError(RuntimeError):
    """Base class of every communication failure."""


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


def blaming(exc: BaseException, culprit: "int | None") -> BaseException:
    """`exc` with `culprit` (the rank at fault, by the group's numbering) set, unless it has one
    or the rank is unknown (None or negative). Returns exc, for `raise blaming(...)`."""
    if culprit is not None and culprit >= 0 and getattr(exc, "culprit", None) is None:
        exc.culprit = culprit  # type: ignore[attr-defined]
    return exc


# How a message carries the culprit where only text survives (torch's C++ re-raises the errors
# of DDP's reducer and of futures as RuntimeError with our message and nothing else).
CULPRIT_MARK = "[culprit: rank {}]"
_CULPRIT_MARK = re.compile(r"\[culprit: rank (\d+)\]")


def culprit_of(exc: BaseException) -> "int | None":
    """The rank a failure blames: exc.culprit, else that of the error it was raised from, else
    the CULPRIT_MARK in its message (errors re-raised by torch); None when nobody is blamed."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        culprit = getattr(exc, "culprit", None)
        if isinstance(culprit, int) and culprit >= 0:
            return culprit
        found = _CULPRIT_MARK.findall(str(exc))
        if found:
            return int(found[-1])
        exc = exc.__cause__ or exc.__context__
    return None
