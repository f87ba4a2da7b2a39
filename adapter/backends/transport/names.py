"""Host names checked before any connection is tried: a name that does not resolve is a
configuration error on every rank at once, not a connect retried until the deadline."""
from __future__ import annotations

import ipaddress
import socket

from ...errors import ConfigError


def check_resolvable(host: str, what: str) -> None:
    """Raise ConfigError naming `what` when host is neither an IP address nor a name that resolves."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ConfigError(f"{what}: host name {host!r} does not resolve ({reason})") from None
