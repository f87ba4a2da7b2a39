"""Exceptions raised by jacklring. Every message names the rank and, where one is involved, the peer."""


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


def blaming(exc: BaseException, culprit: "int | None") -> BaseException:
    """`exc` with `culprit` (the rank at fault, by the group's numbering) set, unless it has one
    or the rank is unknown (None or negative). Returns exc, for `raise blaming(...)`."""
    if culprit is not None and culprit >= 0 and getattr(exc, "culprit", None) is None:
        exc.culprit = culprit  # type: ignore[attr-defined]
    return exc
