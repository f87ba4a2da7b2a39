"""TCP plumbing shared by the socket transports: addresses, listening, connecting with
retries, the connection handshake, and exact reads and writes under a deadline.

A handshake frame identifies who is connecting and why, so a stray connection (garbage,
a port scanner, a rank of another job) is rejected and the listener keeps waiting for
the peer it expects.
"""
from __future__ import annotations

import errno
import logging
import os
import select
import socket
import struct
import sys
import time
from dataclasses import dataclass

from ... import config
from ...errors import CollectiveTimeout, ConfigError, PeerError
from .os_errors import from_os_error

log = logging.getLogger("jacklring.tcp")

HELLO = struct.Struct("<4sHHiiiQ")  # magic, version, purpose, sender rank, receiver rank, channel, job token
MAGIC = b"JKLR"
VERSION = 1
DEFAULT_SPIN_US = 50.0
HELLO_TIMEOUT_S = 1.0  # real peers send it at once; a silent connection must not eat the deadline


@dataclass(frozen=True)
class Hello:
    purpose: int
    sender: int
    receiver: int
    channel: int
    token: int

    def pack(self) -> bytes:
        return HELLO.pack(MAGIC, VERSION, self.purpose, self.sender, self.receiver, self.channel, self.token)


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def spin_seconds(local_ranks: int) -> float:
    """How long poll() busy-waits before sleeping. JACKLRING_SPIN_US when set (0: never);
    otherwise 50 us, unless this host runs more ranks than it has CPUs: then a spinning rank
    only takes the CPU from the peer it waits for, so it sleeps at once (as MPI libraries
    do when oversubscribed)."""
    value = config.get("JACKLRING_SPIN_US")
    if value is None:
        return DEFAULT_SPIN_US * 1e-6 if local_ranks <= available_cpus() else 0.0
    return value * 1e-6


def local_rank_count(addresses: list[str], mine: str) -> int:
    """How many of these "ip:port" addresses are on this rank's host (any loopback counts as one host)."""
    def host(addr: str) -> str:
        h = parse_address(addr)[0]
        return "loopback" if h.startswith("127.") or h in ("::1", "localhost") else h
    me = host(mine)
    return sum(1 for a in addresses if host(a) == me)


def parse_address(text: str, what: str = "address") -> tuple[str, int]:
    """'ip:port' (or '[v6]:port') -> (host, port), with an error naming what was malformed."""
    if not isinstance(text, str) or ":" not in text:
        raise ConfigError(f"{what} {text!r} is not of the form ip:port")
    host, _, port_text = text.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{what} {text!r} has a non-numeric port") from None
    if not 0 <= port <= 65535 or not host:
        raise ConfigError(f"{what} {text!r} is not a valid ip:port")
    return host, port


def format_address(addr: tuple[str, int]) -> str:
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def tune(sock: socket.socket) -> None:
    """Low latency (no Nagle) and buffers large enough to keep a loopback or LAN link busy."""
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer_bytes = config.get("JACKLRING_SOCKET_BUFFER_BYTES")
    if buffer_bytes <= 0:
        return  # leave the kernel's autotuning alone
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
        except OSError:
            pass


def listen(host: str, port: int, backlog: int = 64) -> socket.socket:
    """A listening socket on host:port (port 0 picks a free one)."""
    sock = _new_socket(_family(host), f"socket() for a listener on {format_address((host, port))}")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PeerError(f"cannot listen on {format_address((host, port))}: {exc.strerror or exc}") from None
    sock.listen(backlog)
    return sock


def local_name(host: str, port: int) -> str | None:
    """The abstract Unix socket that a listener on a loopback host:port also listens on (Linux),
    so that ranks on one host skip the TCP/IP stack; None where that does not apply.
    JACKLRING_LOCAL_TRANSPORT=tcp turns it off."""
    if sys.platform != "linux" or config.get("JACKLRING_LOCAL_TRANSPORT") == "tcp":
        return None
    if not (host.startswith("127.") or host in ("::1", "localhost")):
        return None
    return f"\0jacklring-{format_address((host, port))}"


class Listener:
    """A TCP listening socket and, for a loopback address on Linux, an abstract Unix socket of
    the same name (local_name). Peers may arrive on either; both carry the same handshake."""

    def __init__(self, host: str, port: int) -> None:
        self.tcp = listen(host, port)
        self.unix: socket.socket | None = None
        name = local_name(host, self.tcp.getsockname()[1])
        if name is not None:
            try:
                unix = _new_socket(socket.AF_UNIX, f"socket() for a local listener beside "
                                                   f"{format_address(self.tcp.getsockname())}")
            except BaseException:
                self.tcp.close()
                raise
            try:
                unix.bind(name)
                unix.listen(64)
                self.unix = unix
            except OSError:
                unix.close()  # the TCP socket alone still works

    def getsockname(self) -> tuple:
        return self.tcp.getsockname()

    def accept(self, timeout: float) -> tuple[socket.socket, str]:
        """The next connection on either socket and a description of its origin; socket.timeout
        when none arrives in time."""
        ready, _, _ = select.select([s for s in (self.tcp, self.unix) if s is not None], [], [], timeout)
        if not ready:
            raise socket.timeout()
        try:
            sock, peer = ready[0].accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            raise socket.timeout() from None  # the caller waits again
        except OSError as exc:
            raise from_os_error(exc, f"accept() on {format_address(self.tcp.getsockname())}") from None
        return sock, format_address(peer) if isinstance(peer, tuple) else "a local process (Unix socket)"

    def close(self) -> None:
        for sock in (self.tcp, self.unix):
            if sock is not None:
                sock.close()


def _new_socket(family: int, operation: str) -> socket.socket:
    try:
        return socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise from_os_error(exc, operation) from None


def connect(addr: tuple[str, int], hello: Hello, deadline: float, who: str) -> socket.socket:
    """Connect to addr, retrying with backoff until deadline (the peer may not be listening yet),
    then send the handshake. A loopback peer is reached through its Unix socket when it has one
    (see Listener). `who` describes the peer for the error message."""
    delay = 0.01
    last_error = "no attempt made"
    name = local_name(*addr)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PeerError(
                f"could not connect to {who} at {format_address(addr)} before the deadline ({last_error})"
            )
        attempts = ([(socket.AF_UNIX, name)] if name else []) + [(_family(addr[0]), addr)]
        for family, target in attempts:
            sock = _new_socket(family, f"socket() to connect to {who} at {format_address(addr)}")
            try:
                sock.settimeout(min(remaining, 5.0))
                sock.connect(target)
                tune(sock)
                sock.sendall(hello.pack())
                sock.settimeout(None)
                return sock
            except OSError as exc:
                sock.close()
                last_error = exc.strerror or str(exc)
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.5)


def read_hello(sock: socket.socket, timeout: float = HELLO_TIMEOUT_S) -> Hello | None:
    """The peer's handshake, or None when it sent something else (or nothing in time)."""
    sock.settimeout(timeout)
    try:
        data = b""
        while len(data) < HELLO.size:
            chunk = sock.recv(HELLO.size - len(data))
            if not chunk:
                return None
            data += chunk
    except OSError:
        return None
    magic, version, purpose, sender, receiver, channel, token = HELLO.unpack(data)
    if magic != MAGIC or version != VERSION:
        return None
    return Hello(purpose, sender, receiver, channel, token)


def accept(listener: "socket.socket | Listener", deadline: float, accepts, who: str) -> tuple[socket.socket, Hello]:
    """Accept connections until one whose handshake satisfies accepts(hello); others are closed
    with a log line. Raises PeerError naming `who` at the deadline."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PeerError(f"{who} did not connect to {format_address(listener.getsockname())} before the deadline")
        try:
            if isinstance(listener, Listener):
                sock, peer = listener.accept(remaining)
            else:
                listener.settimeout(remaining)
                sock, addr = listener.accept()
                peer = format_address(addr)
        except socket.timeout:
            continue
        except OSError as exc:
            if exc.errno in (errno.EINTR, errno.ECONNABORTED):
                continue
            raise from_os_error(exc, f"accept() on {format_address(listener.getsockname())}") from None
        hello = read_hello(sock, min(HELLO_TIMEOUT_S, max(0.1, deadline - time.monotonic())))
        if hello is not None and accepts(hello):
            tune(sock)
            sock.settimeout(None)
            return sock, hello
        log.warning("rejected a connection from %s on %s: %s", peer,
                    format_address(listener.getsockname()),
                    "bad handshake" if hello is None else f"unexpected {hello}")
        sock.close()


def recv_exact(sock: socket.socket, view: memoryview, deadline: float, who: str) -> None:
    """Fill view from sock, or raise naming `who` (peer closed, error, or deadline)."""
    got = 0
    total = len(view)
    while got < total:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CollectiveTimeout(f"timed out waiting for {total - got} more bytes from {who}")
        sock.settimeout(remaining)
        try:
            n = sock.recv_into(view[got:])
        except socket.timeout:
            continue
        except OSError as exc:
            raise PeerError(f"connection to {who} failed: {exc.strerror or exc}") from None
        if n == 0:
            raise PeerError(f"{who} closed the connection ({total - got} bytes still expected)")
        got += n


def send_all(sock: socket.socket, data, deadline: float, who: str) -> None:
    """Send all of data, or raise naming `who`."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise CollectiveTimeout(f"timed out sending to {who}")
    sock.settimeout(remaining)
    try:
        sock.sendall(data)
    except socket.timeout:
        raise CollectiveTimeout(f"timed out sending to {who} (it is not reading)") from None
    except OSError as exc:
        raise PeerError(f"connection to {who} failed: {exc.strerror or exc}") from None
