"""TCP plumbing shared by the socket transports: addresses, listening, connecting with
retries, the connection handshake, and exact reads and writes under a deadline.

Every connection opens with an authenticated handshake (handshake.py): it identifies who is
connecting and why, and both ends prove the job key, so a stray connection (garbage, a port
scanner, a rank of another job, an outsider) is rejected while the listener keeps waiting
for the peer it expects. On one host, ranks meet over abstract Unix sockets, and only
with a process of the same user (SO_PEERCRED, checked on both ends).
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import socket
import sys
import time
from typing import Callable

from ... import config
from ...errors import CollectiveTimeout, ConfigError, PeerError
from . import holder, layout
from .acceptor import Acceptor, Admit
from .auth import Auth
from .handshake import (  # noqa: F401  (Hello is part of this module's interface)
    MAX_CLOSED_RETRIES,
    HandshakeRetry,
    Hello,
    NotNow,
    OtherJob,
    _recv_fixed,
    client_handshake,
    peer_uid,
)
from .os_errors import from_os_error

log = logging.getLogger("jacklring.tcp")

DEFAULT_SPIN_US = 50.0


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


LISTEN_BACKLOG = 512


def listen(host: str, port: int, backlog: int = LISTEN_BACKLOG, start: bool = True) -> socket.socket:
    """A listening socket on host:port (port 0 picks a free one). The backlog is deep so a
    burst of connections is queued for the acceptor rather than dropped (a dropped SYN costs
    the real peer a one-second retransmission). start=False: bound only; the caller calls
    listen() once whatever must be ready first is."""
    sock = _new_socket(_family(host), f"socket() for a listener on {format_address((host, port))}")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        held = holder.describe(host, port) if exc.errno == errno.EADDRINUSE else ""  # name a squatter
        raise PeerError(f"cannot listen on {format_address((host, port))}: {exc.strerror or exc}{held}") from None
    if start:
        sock.listen(backlog)
    return sock


def local_name(host: str, port: int) -> str | None:
    """The abstract Unix socket that a listener on host:port also listens on (Linux), so that
    ranks on one host skip the TCP/IP stack; None where that does not apply: another host's
    address, or JACKLRING_LOCAL_TRANSPORT=tcp. Abstract sockets belong to a network namespace,
    like the addresses: a name found there is this host's (or a squatter's: connect checks)."""
    if sys.platform != "linux" or config.get("JACKLRING_LOCAL_TRANSPORT") == "tcp":
        return None
    if not (host.startswith("127.") or host in ("::1", "localhost") or own_address(host)):
        return None
    return f"\0jacklring-{format_address((host, port))}"


@functools.lru_cache(maxsize=256)
def own_address(host: str) -> bool:
    """Whether host is an address of this host (of its network namespace): one a socket can
    bind to. Not only loopback: a hostfile usually names the hosts' own interfaces."""
    try:
        with socket.socket(_family(host), socket.SOCK_DGRAM) as probe:
            probe.bind((host, 0))
        return True
    except (OSError, ValueError):
        return False


_squat_reported: set[str] = set()


def _report_squat(name: str, uid: int | None, side: str) -> None:
    """Log once per name: another user holds the abstract socket a rank should own."""
    if name in _squat_reported:
        return
    _squat_reported.add(name)
    owner = f"uid {uid}" if uid is not None else "another process"
    log.warning("the local socket @%s is held by %s, not by this job's user (uid %d): someone squats it; "
                "%s uses TCP for this address instead", name[1:], owner, os.getuid(), side)


class Listener:
    """A TCP listening socket and, on Linux, an abstract Unix socket of the same name
    (local_name). Peers may arrive on either; both carry the same handshake.

    serve() starts the acceptor thread that authenticates arrivals; take() hands over the
    authenticated connections the caller is waiting for."""

    def __init__(self, host: str, port: int, local: bool = True) -> None:
        # TCP listens last: a peer on this host tries the Unix name first and falls back to TCP
        # when nothing answers there, so TCP open before the name would cost it the Unix socket.
        self.tcp = listen(host, port, start=False)
        self.unix: socket.socket | None = None
        self._acceptor: Acceptor | None = None
        self._held = False
        name = local_name(host, self.tcp.getsockname()[1]) if local else None
        if name is not None:
            try:
                unix = _new_socket(socket.AF_UNIX, f"socket() for a local listener beside "
                                                   f"{format_address(self.tcp.getsockname())}")
            except BaseException:
                self.tcp.close()
                raise
            try:
                unix.bind(name)
                unix.listen(LISTEN_BACKLOG)
                self.unix = unix
            except OSError:
                unix.close()  # the TCP socket alone still works; peers notice the squatter's uid
                _report_squat(name, None, "this listener")
        self.tcp.listen(LISTEN_BACKLOG)

    @classmethod
    def adopt(cls, sock: socket.socket) -> "Listener":
        """A Listener around an already listening TCP socket."""
        self = cls.__new__(cls)
        self.tcp, self.unix, self._acceptor, self._held = sock, None, None, False
        return self

    def getsockname(self) -> tuple:
        return self.tcp.getsockname()

    def where(self) -> str:
        return format_address(self.tcp.getsockname()[:2])

    def serve(self, auth: Auth, token: int, rank: int, admit: Admit, label: str,
              check: "tuple[layout.Check, str] | None" = None) -> None:
        """Start accepting: connections that prove `auth`'s key for job context `token`, are
        addressed to `rank` and pass admit() are queued for take(). With check (this rank's
        layout, this listener's address as listed), layout checks are answered (layout.py)."""
        if self._acceptor is None:
            self._acceptor = Acceptor([self.tcp, self.unix], self.where(), auth, token, rank, admit, label, check)

    def reserve(self, auth: Auth, token: int, rank: int, admit: Admit, label: str,
                check: "tuple[layout.Check, str] | None" = None) -> None:
        """serve() anew (another key, job context or admission) on the same bound sockets: the
        old acceptor stops, the address is never released, so nobody else can take it meanwhile."""
        if self._acceptor is not None:
            self._acceptor.close()
            self._acceptor = None
        self.serve(auth, token, rank, admit, label, check)

    def layout_conflicts(self) -> list:
        """(view, from where) of each peer that proved the layout key with a layout of its own."""
        return self._acceptor.layout_conflicts() if self._acceptor is not None else []

    def take(self, match, deadline: float, who: str | None) -> tuple[socket.socket, Hello] | None:
        """The next authenticated connection whose hello satisfies match (the hello carries
        both handshake nonces: Hello.session). At the deadline: PeerError naming `who` (and any
        rejected impostors), or None when who is None."""
        assert self._acceptor is not None, "Listener.serve() was not called"
        item = self._acceptor.take(match, deadline)
        if item is not None:
            hello, sock, _ = item
            tune(sock)
            return sock, hello
        if who is None:
            return None
        raise PeerError(f"{who} did not connect to {self.where()} before the deadline"
                        f"{self._acceptor.rejected_summary()}")

    def rejected_summary(self) -> str:
        """"; meanwhile N unauthenticated connection(s) were rejected (from ...)", or "" when none
        were: for the error of a caller that waited here in vain."""
        return self._acceptor.rejected_summary() if self._acceptor is not None else ""

    def arriving(self, purpose: int) -> set[int]:
        """Senders of connections of `purpose` still in their handshake (Acceptor.arriving)."""
        return self._acceptor.arriving(purpose) if self._acceptor is not None else set()

    def ready_fd(self) -> int:
        """A descriptor that becomes readable when an authenticated connection waits for take()."""
        assert self._acceptor is not None, "Listener.serve() was not called"
        return self._acceptor.ready_fd()

    def drain_ready(self) -> None:
        if self._acceptor is not None:
            self._acceptor.drain_ready()

    def hold(self) -> None:
        """Make close() leave this listener open, and serving, until release(): a shrink keeps
        the first listener of a group that failed to form as its seat in that group's agreement
        (elastic/shrinking.py)."""
        self._held = True

    def release(self) -> None:
        """Undo hold(): the next close() closes."""
        self._held = False

    def farewell(self, frame: bytes, match: Callable[[Hello], bool]) -> None:
        """Send `frame` on each acknowledged connection matching `match` that is closed untaken
        (see Acceptor.farewell)."""
        if self._acceptor is not None:
            self._acceptor.farewell(frame, match)

    def readmit(self, admit: Admit) -> None:
        """Admit arrivals by `admit` from now on (see Acceptor.readmit)."""
        assert self._acceptor is not None, "Listener.serve() was not called"
        self._acceptor.readmit(admit)

    def close(self) -> None:
        if self._held:
            return
        if self._acceptor is not None:
            self._acceptor.close()
            self._acceptor = None
        for sock in (self.tcp, self.unix):
            if sock is not None:
                sock.close()


def _new_socket(family: int, operation: str) -> socket.socket:
    try:
        return socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise from_os_error(exc, operation) from None


class PeerGone(PeerError):
    """connect_with_hello(gone_after=...): the peer's address refused every connection for that
    long: it listened there once and has left."""


def connect(addr: tuple[str, int], hello: Hello, deadline: float, who: str, auth: Auth,
            pause: Callable[[float], None] | None = None) -> socket.socket:
    """Connect to addr, retrying with backoff until deadline (the peer may not be listening yet),
    and run the handshake. A peer at an address of this host is reached through its Unix socket
    when one of this user's processes holds it (see Listener). `who` describes the peer for the error message.
    A listener that answers but is not a rank of this job fails at once (PeerError).
    pause(seconds) waits between attempts (default: sleep); a forming group passes one that
    watches its other connections meanwhile and raises when the formation is abandoned."""
    return connect_with_hello(addr, hello, deadline, who, auth, pause)[0]


def connect_with_hello(addr: tuple[str, int], hello: Hello, deadline: float, who: str, auth: Auth,
                       pause: Callable[[float], None] | None = None,
                       other_job: Callable[[], None] | None = None,
                       retry: bool = True, gone_after: float | None = None) -> tuple[socket.socket, Hello]:
    """connect(), also returning the hello as sent with both handshake nonces (Hello.session),
    for keys that belong to this connection alone. other_job() is called whenever the listener
    answers as a rank of another job context (it may raise: a layout check, see layout.py).
    retry=False: one attempt (the Unix socket, then TCP); a refusal, or a listener that closes
    without answering, is a PeerError at once (a notice to a rank that has left needs no retry).
    gone_after: for a peer that listened once (a member of a formed group): its address refusing
    every attempt for this many seconds is a PeerError then, not a wait for the deadline. Only a
    closed listener refuses (a busy one lets the connection wait), so the peer has left."""
    delay = 0.01
    last_error = "no attempt made"
    name = local_name(*addr)
    where = format_address(addr)
    closed_without_answer = 0
    refused_since: float | None = None
    while True:
        now = time.monotonic()
        remaining = deadline - now
        if remaining <= 0:
            raise PeerError(f"could not connect to {who} at {where} before the deadline ({last_error})")
        if refused_since is not None and gone_after is not None and now - refused_since >= gone_after:
            raise PeerGone(f"{who} has left: its address {where} refused every connection for "
                            f"{now - refused_since:.1f} s (nothing listens there any more: it exited or "
                            f"closed the group)")
        attempts = ([(socket.AF_UNIX, name)] if name and name not in _squat_reported else [])
        attempts.append((_family(addr[0]), addr))
        for family, target in attempts:
            sock = _new_socket(family, f"socket() to connect to {who} at {format_address(addr)}")
            try:
                sock.settimeout(min(remaining, 5.0))
                sock.connect(target)
                if family == socket.AF_UNIX:
                    uid = peer_uid(sock)
                    if uid != os.getuid():
                        _report_squat(name, uid, f"the connection to {who}")  # type: ignore[arg-type]
                        sock.close()
                        continue
                done = client_handshake(sock, hello.fresh(), auth, where, who, deadline=deadline)
                tune(sock)
                sock.settimeout(None)
                return sock, done
            except HandshakeRetry as exc:
                sock.close()
                closed_without_answer += 1
                last_error = str(exc)
                if closed_without_answer >= MAX_CLOSED_RETRIES:
                    raise PeerError(f"the process listening on {where} (expected: {who}) closed "
                                    f"{closed_without_answer} connections without answering the jacklring "
                                    f"handshake; another program listens on that address") from None
            except OtherJob as exc:
                sock.close()
                last_error = str(exc)  # an earlier incarnation of the peer still listens: wait for it
                if other_job is not None:
                    other_job()
            except PeerError:
                sock.close()
                raise
            except OSError as exc:
                sock.close()
                last_error = exc.strerror or str(exc)
                if family != socket.AF_UNIX:  # TCP is the last attempt of the round: it decides
                    refused = isinstance(exc, ConnectionRefusedError)
                    refused_since = (refused_since or time.monotonic()) if refused else None
        if not retry:
            raise PeerError(f"could not connect to {who} at {where} ({last_error})")
        (pause or time.sleep)(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.5)


def open_to(address: str, timeout: float) -> socket.socket:
    """A connected socket to the listener at address: its Unix socket when a process of this
    user holds it (on this host), else TCP. Over the Unix socket the acceptor knows this user
    by SO_PEERCRED and counts its handshakes apart from everyone's at the same IP, so a flood
    from 127.0.0.1 (any local user's) cannot spend them. OSError when neither connects."""
    host, port = parse_address(address)
    name = local_name(host, port)
    if name and name not in _squat_reported:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(name)
            uid = peer_uid(sock)
            if uid == os.getuid():
                return sock
            _report_squat(name, uid, f"a connection to {address}")
        except OSError:
            pass
        sock.close()
    return socket.create_connection((host, port), timeout=timeout)


def ask_layout(check: layout.Check, address: str, peer: int, until: float) -> layout.View | None:
    """The layout of the rank listening at address (which this rank numbers `peer`), compared
    under the layout key (layout.py); None when it does not prove that key (a stranger, a rank
    without a layout check, no answer before until). Never raises for what the listener does."""
    host, port = parse_address(address)
    key = check.key_at(address)
    hello = Hello(layout.PURPOSE_LAYOUT, check.view.rank, peer, 0, 0).fresh()
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
            sock.settimeout(max(0.01, until - time.monotonic()))
            sock.connect((host, port))
            done = client_handshake(sock, hello, key, address, f"rank {peer}", deadline=until)
            sock.sendall(check.frame(key, b"C", done.session))
            data = _recv_fixed(sock, layout.FRAME.size, until, layout.MAGIC)
    except (PeerError, HandshakeRetry, OSError):
        return None
    return layout.read(key, b"A", done.session, data)


def recv_exact(sock: socket.socket, view: memoryview, deadline: float, who: str,
               silence: float | None = None) -> None:
    """Fill view from sock, or raise naming `who` (peer closed, error, or deadline). With
    `silence`, the deadline measures silence: every chunk that arrives moves it that far on."""
    got = 0
    total = len(view)
    while got < total:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            quiet = "" if silence is None else f" (nothing arrived for {silence:g} s)"
            raise CollectiveTimeout(f"timed out waiting for {total - got} more bytes from {who}{quiet}")
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
        if silence is not None:
            deadline = time.monotonic() + silence


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
