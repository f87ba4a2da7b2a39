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


class ExcludedError(PeerError):
    """This rank was left out of the group a shrink() formed (it was dead, stopped or too slow to
    answer in time, or named in exclude=): it must not rejoin; it stops or starts a new job."""


class QuorumError(DistributedError):
    """shrink() found too few ranks alive to form a group (no more than half of the old group,
    or fewer than min_size): a minority part must not carry on as if it were the job."""
