"""OS errors at a system boundary (socket(), accept(), listen()) as DistributedError subclasses
that name the operation and, for a refused resource, the limit that was hit."""
from __future__ import annotations

import errno
import resource

from ...errors import DistributedError, PeerError, ResourceExhausted

_FD_ERRORS = (errno.EMFILE, errno.ENFILE)
_RESOURCE_ERRORS = _FD_ERRORS + (errno.ENOMEM, errno.ENOBUFS, errno.EADDRNOTAVAIL)


def _fd_limit_text(code: int) -> str:
    if code == errno.ENFILE:
        return "the system-wide open file limit (fs.file-max) is reached"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (f"this process reached its open file limit (RLIMIT_NOFILE soft {soft}, hard {hard}); "
            f"raise it (ulimit -n) or open fewer groups")


def from_os_error(exc: OSError, operation: str) -> DistributedError:
    """The DistributedError for exc raised by `operation` (e.g. "socket() for a listener on ...")."""
    reason = exc.strerror or str(exc)
    name = errno.errorcode.get(exc.errno or 0, "")
    if exc.errno in _FD_ERRORS:
        return ResourceExhausted(f"{operation} failed: {reason} ({name}): {_fd_limit_text(exc.errno)}")
    if exc.errno in _RESOURCE_ERRORS:
        return ResourceExhausted(f"{operation} failed: {reason} ({name}): the system is out of "
                                 f"{'local ports' if exc.errno == errno.EADDRNOTAVAIL else 'memory or buffers'}")
    return PeerError(f"{operation} failed: {reason}" + (f" ({name})" if name else ""))
