"""The connection handshake: who is connecting, why, and proof that both ends belong to the job.

    connector -> acceptor  HELLO      magic, version, purpose, sender, receiver, channel, job context, nonce_c
    acceptor -> connector  CHALLENGE  magic, status, nonce_s
    connector -> acceptor  PROOF      HMAC(key, "C" | HELLO | nonce_s)
    acceptor -> connector  ACK        magic, status, HMAC(key, "A" | HELLO | nonce_s | PROOF | status)
                                      (status OK only; a bad proof gets BAD_PROOF and no MAC)

Each side proves the key over a nonce the other side just chose, so neither a recorded
handshake nor a relay that does not know the key gets through, and a connection counts on
either side only once both proofs checked (the connector waits for the ACK). The connector
proves first and the acceptor computes its MAC only over a proof that checked: anyone may
connect to a listener, and no MAC of the key must ever reach them (it would let them test
guesses of the secret offline, as version 2 did). The connector's proof does reach whatever
listens where it connects, a squatter included; that is why a user-set secret is stretched with scrypt
and passphrases must be strong (auth.py). Both nonces,
known to both ends when it is done (Hello.session), key the connection's message MACs
(integrity.for_link), so no two connections share those keys. Every frame has a
fixed size: there is no length field to lie about.

The acceptor side runs in a thread per listener (Acceptor): connections are accepted as they
come, their handshakes progress side by side without blocking the job, each must finish
within HANDSHAKE_TIMEOUT_S, and at most MAX_PENDING wait at once (the oldest is dropped when a
new one arrives), so a flood of silent connections delays a real peer by at most about that
timeout. Each source (an IP address, or a local uid) may start HANDSHAKES_PER_S handshakes a
second (a burst of BURST): beyond that a connection is closed unread, without a poll slot, a
nonce or a MAC check, so a flood of connections costs the thread an accept and a close each.
Authenticated connections wait in a queue until the backend takes them. A layout check
(layout.py) is answered here too, after its own handshake under the layout key: a layout that
differs is recorded (layout_conflicts) and wakes the consumer as an arrival does.
"""
from __future__ import annotations

import atexit
import errno
import logging
import os
import select
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable

from ...errors import PeerError
from . import layout
from .auth import MAC_BYTES, NONCE_BYTES, Auth, equal
from .source_budget import BURST, HANDSHAKES_PER_S, SourceBudget

log = logging.getLogger("jacklring.tcp")

HELLO = struct.Struct(f"<4sHHiiiQ{NONCE_BYTES}s")
CHALLENGE = struct.Struct(f"<4sB{NONCE_BYTES}s")
PROOF_BYTES = MAC_BYTES
ACK = struct.Struct(f"<4sB{MAC_BYTES}s")
MAGIC, CHALLENGE_MAGIC, ACK_MAGIC = b"JKLR", b"JKLC", b"JKLA"
VERSION = 3   # 2 answered any HELLO with a MAC of the key

OK, OTHER_JOB, UNEXPECTED, BAD_PROOF, ALIVE = 0, 1, 2, 3, 4
# A liveness probe (transport/blame.py): the acceptor answers its HELLO with a CHALLENGE of
# status ALIVE and closes, nothing queued or logged. The acceptor thread answering proves the
# process runs (a stopped one's kernel accepts for it, nobody answers; a dead one refuses).
PURPOSE_PROBE = 0x5052  # "PR"
STATUS_TEXT = {OTHER_JOB: "it belongs to another job (different job context)",
               UNEXPECTED: "it was not expected there (wrong rank, purpose or connection)",
               BAD_PROOF: "it did not prove the job secret"}

HANDSHAKE_TIMEOUT_S = 1.0    # acceptor: a real peer finishes in milliseconds
ANSWER_TIMEOUT_S = 5.0       # connector: how long a listener may stay silent before it is called foreign
MAX_PENDING = 64             # unfinished handshakes per listener
MAX_LOGGED = 20              # rejections logged one by one per listener; the rest are counted
MAX_CLOSED_RETRIES = 20      # listener closes our connection before answering: retried this often


@dataclass(frozen=True)
class Hello:
    purpose: int
    sender: int
    receiver: int
    channel: int
    token: int                      # the job context id (auth.context_id), in the clear
    nonce: bytes = field(default=bytes(NONCE_BYTES), compare=False, repr=False)
    # The acceptor's nonce, known to both ends once the handshake is done (not in the frame).
    server_nonce: bytes = field(default=b"", compare=False, repr=False)

    @property
    def session(self) -> bytes:
        """Both handshake nonces: what no other connection shares, even one of the same job,
        ranks and purpose (a key derived from it is this connection's alone)."""
        return self.nonce + self.server_nonce

    def pack(self) -> bytes:
        return HELLO.pack(MAGIC, VERSION, self.purpose, self.sender, self.receiver, self.channel,
                          self.token, self.nonce)

    def fresh(self) -> "Hello":
        return Hello(self.purpose, self.sender, self.receiver, self.channel, self.token, os.urandom(NONCE_BYTES))


def parse_hello(data: bytes) -> Hello | None:
    if len(data) != HELLO.size:
        return None
    magic, version, purpose, sender, receiver, channel, token, nonce = HELLO.unpack(data)
    if magic != MAGIC or version != VERSION:
        return None
    return Hello(purpose, sender, receiver, channel, token, nonce)


# ---- connector side -----------------------------------------------------------------------------

class HandshakeRetry(Exception):
    """The listener closed the connection before answering (it may be shedding load): try again."""


class OtherJob(PeerError):
    """The listener is a jacklring rank of another job context: often this job's peer still in
    an earlier incarnation of the group (it has not closed and re-formed yet), so the connector
    tries again until its deadline."""


def _recv_fixed(sock: socket.socket, size: int, timeout_at: float, magic: bytes) -> bytes:
    """Up to size bytes; fewer when the peer closes, or as soon as they cannot start with magic
    (a foreign service is named at once). A reset after some bytes counts as a close."""
    data = bytearray()
    while len(data) < size:
        remaining = timeout_at - time.monotonic()
        if remaining <= 0:
            raise socket.timeout()
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(size - len(data))
        except ConnectionResetError:
            if data:
                break
            raise
        if not chunk:
            break
        data += chunk
        if data[:len(magic)] != magic[:len(data)]:
            break
    return bytes(data)


def client_handshake(sock: socket.socket, hello: Hello, auth: Auth, where: str, who: str,
                     answer_timeout: float = ANSWER_TIMEOUT_S, deadline: float | None = None) -> Hello:
    """Run the connector's half on a connected socket; returns hello with the acceptor's nonce.
    PeerError (final) when the listener is not a rank of this job or refuses this rank;
    HandshakeRetry when it closed without a word. The answer is awaited answer_timeout (shrink()
    passes a short one), or until the caller's deadline when that comes first: a stopped rank's
    kernel accepts for it, nobody answers."""
    hello_bytes = hello.pack()
    answer_s = answer_timeout if deadline is None else max(0.01, min(answer_timeout, deadline - time.monotonic()))
    try:
        sock.settimeout(answer_s)
        sock.sendall(hello_bytes)
        answer = _recv_fixed(sock, CHALLENGE.size, time.monotonic() + answer_s, CHALLENGE_MAGIC)
    except socket.timeout:
        if answer_s < answer_timeout:
            silent = PeerError(f"{who} at {where} accepted the connection but did not answer the jacklring "
                               f"handshake before the deadline (stopped, or too busy to answer)")
            # Its acceptor thread (which answers whatever its main thread does) said nothing for
            # the whole deadline: it is the silent one, and it will send no notice either.
            silent.unanswered = True  # type: ignore[attr-defined]
            raise silent from None
        raise PeerError(f"the process listening on {where} (expected: {who}) accepted the connection but did "
                        f"not answer the jacklring handshake within {answer_s:.3g} s; another program "
                        f"listens on that address, or the rank is stopped") from None
    except OSError as exc:
        if exc.errno in (errno.ECONNRESET, errno.EPIPE):
            raise HandshakeRetry(exc.strerror or str(exc)) from None
        raise
    if not answer:
        raise HandshakeRetry("the listener closed the connection before answering the handshake")
    if len(answer) < CHALLENGE.size or answer[:4] != CHALLENGE_MAGIC:
        raise PeerError(f"the process listening on {where} (expected: {who}) is not a jacklring rank: it "
                        f"answered the handshake with {answer[:16].hex() or 'nothing'}")
    _, status, nonce_s = CHALLENGE.unpack(answer)
    if status != OK:
        refusal = OtherJob if status == OTHER_JOB else PeerError
        raise refusal(f"{who} at {where} refused this connection: {STATUS_TEXT.get(status, f'status {status}')}")
    proof = auth.mac(b"C", hello_bytes, nonce_s)
    try:
        sock.sendall(proof)
        ack_s = answer_s if deadline is None else max(0.01, min(answer_s, deadline - time.monotonic()))
        sock.settimeout(ack_s)
        ack = _recv_fixed(sock, ACK.size, time.monotonic() + ack_s, ACK_MAGIC)
    except socket.timeout:
        raise PeerError(f"{who} at {where} did not acknowledge the handshake within {ack_s:.3g} s") from None
    except OSError as exc:
        if exc.errno in (errno.ECONNRESET, errno.EPIPE):
            raise HandshakeRetry(exc.strerror or str(exc)) from None
        raise
    if not ack:
        raise HandshakeRetry("the listener closed the connection before acknowledging the handshake")
    if len(ack) < ACK.size:
        raise PeerError(f"{who} at {where} sent a malformed handshake acknowledgement ({ack[:8].hex()})")
    magic, status, mac_a = ACK.unpack(ack)
    if magic == ACK_MAGIC and status == BAD_PROOF:  # unauthenticated: a refusal carries no MAC
        raise PeerError(f"{who} at {where} refused this rank's proof: this rank did not prove the job secret "
                        f"it holds there (were the ranks given different job secrets?)")
    if magic != ACK_MAGIC or status != OK or not equal(mac_a, auth.mac(b"A", hello_bytes, nonce_s, proof,
                                                                       bytes([status]))):
        raise PeerError(f"the process listening on {where} (expected: {who}) did not prove the job secret: a "
                        f"process outside this job listens there, or the ranks were given different secrets")
    return replace(hello, server_nonce=nonce_s)


# ---- acceptor side ------------------------------------------------------------------------------

def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (Linux SO_PEERCRED)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    return struct.unpack("3i", raw)[1]


class _Pending:
    __slots__ = ("sock", "peer", "expires", "buf", "need", "hello", "hello_bytes", "nonce_s", "key", "checking")

    def __init__(self, sock: socket.socket, peer: str, expires: float) -> None:
        self.sock, self.peer, self.expires = sock, peer, expires
        self.buf = bytearray()
        self.need = HELLO.size
        self.hello: Hello | None = None
        self.hello_bytes = b""
        self.nonce_s = b""
        self.key: Auth | None = None   # a layout check's key (None: the job's)
        self.checking = False          # authenticated layout check: its frame is awaited


Admit = Callable[[Hello], "str | None"]   # None: welcome; else why it is refused


class Acceptor:
    """Accepts and authenticates connections on listening sockets in a background thread."""

    def __init__(self, sockets: list[socket.socket], where: str, auth: Auth, token: int, rank: int,
                 admit: Admit, label: str, check: "tuple[layout.Check, str] | None" = None) -> None:
        self._listening = [s for s in sockets if s is not None]
        for s in self._listening:
            s.setblocking(False)
        self._where = where
        self._auth = auth
        self._token = token
        self._rank = rank
        self._admit = admit
        self._label = label
        # (this rank's layout, this listener's address as the hostfile spells it): layout checks
        # are answered (under the key at that address); None: refused as unexpected.
        self._check = check
        self._conflicts: list[tuple[layout.View, str]] = []
        self._pending: list[_Pending] = []
        # The connection whose acknowledgement is being sent: out of _pending, not yet in _ready,
        # but the connector may already have it (and go on, and leave): still arriving.
        self._acking: _Pending | None = None
        self._ready: list[tuple[Hello, socket.socket, str]] = []
        self._cond = threading.Condition()
        self._rejected = 0
        self._rejected_from: list[str] = []
        self._budget = SourceBudget()
        self._shed = 0   # connections closed unread: their source was over its handshake budget
        self._closed = False
        # (which hellos, frame): an acknowledged connection of those that is closed untaken gets
        # the frame first (see farewell)
        self._farewell: tuple[Callable[[Hello], bool], bytes] | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        # A byte per authenticated arrival: a consumer can sleep in poll() on other sockets too.
        self._ready_r, self._ready_w = socket.socketpair()
        self._ready_w.setblocking(False)
        self._ready_r.setblocking(False)
        self._thread = threading.Thread(target=self._loop, name=f"jacklring-accept {where}", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # ---- the consumer's side

    def take(self, match: Callable[[Hello], bool], deadline: float) -> tuple[Hello, socket.socket, str] | None:
        """The first authenticated connection whose hello satisfies match, waiting until deadline
        (None then)."""
        with self._cond:
            while True:
                for i, item in enumerate(self._ready):
                    if match(item[0]):
                        del self._ready[i]
                        return item
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return None
                self._cond.wait(min(remaining, 1.0))

    def arriving(self, purpose: int) -> set[int]:
        """The senders whose connection of `purpose` to this rank, in this job context, is still
        in its handshake (its hello read, not yet proven): not authenticated, so only a reason
        to wait a little for it, never evidence on its own."""
        with self._cond:
            acking = self._acking
            return {p.hello.sender for p in list(self._pending) + ([acking] if acking is not None else [])
                    if p.hello is not None and p.hello.purpose == purpose and p.hello.token == self._token
                    and p.hello.receiver == self._rank}

    def ready_fd(self) -> int:
        """Readable after an authenticated connection joined the queue (see drain_ready)."""
        return self._ready_r.fileno()

    def drain_ready(self) -> None:
        """Consume the readiness bytes; call before looking at the queue with take()."""
        try:
            while self._ready_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError, OSError):
            pass

    def layout_conflicts(self) -> list[tuple[layout.View, str]]:
        """The views of peers that proved the layout key and hold a layout other than this
        rank's, with where they connected from (see layout.py)."""
        with self._cond:
            return list(self._conflicts)

    def rejected_summary(self) -> str:
        with self._cond:
            if not self._rejected:
                return ""
            sources = ", ".join(sorted(set(self._rejected_from))[:5])
            shed = f", {self._shed} more closed unread (over their source's budget)" if self._shed else ""
            return (f"; meanwhile {self._rejected} unauthenticated connection(s) were rejected (from {sources})"
                    f"{shed}")

    def readmit(self, admit: Admit) -> None:
        """Admit by `admit` from now on; a connection already waiting for take() that it would
        refuse is closed (its peer sees the end of the stream)."""
        with self._cond:
            self._admit = admit
            dropped = [item for item in self._ready if admit(item[0]) is not None]
            self._ready = [item for item in self._ready if item not in dropped]
            farewell, self._farewell = self._farewell, None  # a new use of this listener
        for hello, sock, _ in dropped:
            self._dismiss(hello, sock, farewell)

    def farewell(self, frame: bytes, match: Callable[[Hello], bool]) -> None:
        """From now on, a connection whose hello satisfies match that this acceptor acknowledged
        but nobody took is sent `frame` (then the end of its stream) when it is closed: by close(),
        by readmit(), or acknowledged after close(). A formation that gave up passes its verdict
        this way to a neighbour whose connection it had not taken yet: for that neighbour the
        connection is made (the acknowledgement came), and a bare close would name this rank."""
        with self._cond:
            self._farewell = (match, frame)

    @staticmethod
    def _dismiss(hello: Hello, sock: socket.socket,
                 farewell: "tuple[Callable[[Hello], bool], bytes] | None") -> None:
        if farewell is not None and farewell[0](hello):
            try:
                sock.send(farewell[1], socket.MSG_DONTWAIT)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        sock.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            ready, self._ready = self._ready, []
            farewell = self._farewell
            self._cond.notify_all()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(2.0)
        for hello, sock, _ in ready:
            self._dismiss(hello, sock, farewell)
        self._ready_r.close()
        self._ready_w.close()

    # ---- the thread

    def _reject(self, item: _Pending, why: str, status: int | None = None) -> None:
        if status is not None:
            frame = (CHALLENGE.pack(CHALLENGE_MAGIC, status, bytes(NONCE_BYTES))
                     if item.hello is not None and not item.nonce_s else None)
            if frame is not None:
                try:
                    item.sock.send(frame)
                except OSError:
                    pass
        item.sock.close()
        with self._cond:
            self._rejected += 1
            if len(self._rejected_from) < 64:
                self._rejected_from.append(item.peer)
            count = self._rejected
        if count <= MAX_LOGGED:
            log.warning("%s: an unauthenticated connection from %s was rejected on %s: %s",
                        self._label, item.peer, self._where, why)
            if count == MAX_LOGGED:
                log.warning("%s: further rejected connections on %s are counted, not logged", self._label, self._where)

    def _loop(self) -> None:
        try:
            self._run()
        except Exception:  # never take the job down from here; the deadline names the missing peer
            log.exception("%s: the acceptor on %s stopped", self._label, self._where)
        finally:
            for item in self._pending:
                item.sock.close()
            for s in (self._wake_r, self._wake_w):
                s.close()

    def _run(self) -> None:
        while not self._closed:
            now = time.monotonic()
            for item in [p for p in self._pending if p.expires <= now]:
                self._pending.remove(item)
                self._reject(item, "no complete handshake within "
                             f"{HANDSHAKE_TIMEOUT_S:g} s" if item.buf or item.hello else
                             f"it sent nothing within {HANDSHAKE_TIMEOUT_S:g} s")
            timeout = min((p.expires for p in self._pending), default=now + 1.0) - now
            # poll, not select: a process with many open files has descriptors above 1024
            poller = select.poll()
            by_fd: dict[int, object] = {}
            for s in (*self._listening, self._wake_r):
                by_fd[s.fileno()] = s
            for p in self._pending:
                by_fd[p.sock.fileno()] = p
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            try:
                events = poller.poll(max(0.0, timeout) * 1000)
            except OSError:
                if self._closed:
                    return
                raise
            if self._closed:
                return
            for fd, _ in events:
                target = by_fd.get(fd)
                if isinstance(target, _Pending):
                    if target in self._pending:
                        self._progress(target)
                elif target is not None and target is not self._wake_r:
                    self._accept_all(target)  # type: ignore[arg-type]

    def _accept_all(self, listening: socket.socket) -> None:
        while True:
            try:
                sock, addr = listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.ECONNABORTED, errno.EMFILE, errno.ENFILE, errno.ENOBUFS):
                    return
                raise
            uid = peer_uid(sock) if sock.family == socket.AF_UNIX else None
            source = ("uid", uid) if sock.family == socket.AF_UNIX else (addr[0] if isinstance(addr, tuple) else addr)
            if not self._budget.take(source):
                sock.close()  # no handshake work for a source beyond its budget; a real rank retries
                self._shed += 1
                if self._shed == 1:
                    log.warning("%s: %s opens more than %g connections per second (burst %d) on %s: the "
                                "excess is closed unread", self._label, _describe(addr), HANDSHAKES_PER_S,
                                BURST, self._where)
                continue
            peer = _describe(addr)
            item = _Pending(sock, peer, time.monotonic() + HANDSHAKE_TIMEOUT_S)
            if sock.family == socket.AF_UNIX:
                if uid != os.getuid():
                    self._reject(item, f"the local process belongs to uid {uid}, not this job's user")
                    continue
            sock.setblocking(False)
            self._pending.append(item)
            if len(self._pending) > MAX_PENDING:
                oldest = self._pending.pop(0)
                self._reject(oldest, f"more than {MAX_PENDING} connections were waiting to finish a handshake")

    def _progress(self, item: _Pending) -> None:
        try:
            chunk = item.sock.recv(item.need - len(item.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            chunk = b""
            if item.buf or item.hello:
                log.debug("connection from %s failed during the handshake: %s", item.peer, exc)
        if not chunk:
            self._pending.remove(item)
            if item.buf or item.hello:
                self._reject(item, "it closed the connection during the handshake")
            else:
                item.sock.close()  # connected and left without a word: a liveness probe
            return
        item.buf += chunk
        if item.hello is None and item.buf[:len(MAGIC)] != MAGIC[:len(item.buf)]:
            self._pending.remove(item)
            self._reject(item, f"not a jacklring handshake (first bytes {bytes(item.buf[:8]).hex()})")
            return
        if len(item.buf) < item.need:
            return
        data, item.buf = bytes(item.buf), bytearray()
        if item.hello is None:
            self._on_hello(item, data)
        elif item.checking:
            self._on_layout(item, data)
        else:
            self._on_proof(item, data)

    def _on_hello(self, item: _Pending, data: bytes) -> None:
        hello = parse_hello(data)
        if hello is None:
            self._pending.remove(item)
            self._reject(item, f"not a jacklring handshake (first bytes {data[:8].hex()})")
            return
        item.hello, item.hello_bytes = hello, data
        if hello.purpose == PURPOSE_PROBE and hello.token == self._token and hello.receiver == self._rank:
            self._pending.remove(item)
            self._send(item, CHALLENGE.pack(CHALLENGE_MAGIC, ALIVE, bytes(NONCE_BYTES)))
            item.sock.close()
            return
        refusal = self._refusal(hello)
        if refusal is not None:
            self._pending.remove(item)
            self._reject(item, f"claimed {hello.purpose:#x} from rank {hello.sender} to rank {hello.receiver}, "
                         f"connection {hello.channel}: {refusal[1]}", refusal[0])
            return
        item.nonce_s = os.urandom(NONCE_BYTES)
        item.need = PROOF_BYTES
        if hello.purpose == layout.PURPOSE_LAYOUT and self._check is not None:
            item.key = self._check[0].key_at(self._check[1])
        if not self._send(item, CHALLENGE.pack(CHALLENGE_MAGIC, OK, item.nonce_s)):
            self._pending.remove(item)
            self._reject(item, "it did not take the handshake's challenge")

    def _refusal(self, hello: Hello) -> tuple[int, str] | None:
        if hello.purpose == layout.PURPOSE_LAYOUT:  # any job context: a rank of other layout asks
            return None if self._check is not None else (UNEXPECTED, "no layout check is answered here")
        if hello.token != self._token:
            return OTHER_JOB, "another job's context"
        if hello.receiver != self._rank:
            return UNEXPECTED, f"this is rank {self._rank}"
        why = self._admit(hello)
        if why is not None:
            return UNEXPECTED, why
        return None

    def _on_proof(self, item: _Pending, proof: bytes) -> None:
        self._pending.remove(item)
        self._acking = item
        try:
            self._acknowledge(item, proof)
        finally:
            self._acking = None

    def _acknowledge(self, item: _Pending, proof: bytes) -> None:
        hello = item.hello
        assert hello is not None
        key = item.key or self._auth
        if not equal(proof, key.mac(b"C", item.hello_bytes, item.nonce_s)):
            # The refusal carries no MAC: nothing an outsider could test a guess of the key against.
            self._send(item, ACK.pack(ACK_MAGIC, BAD_PROOF, bytes(MAC_BYTES)))
            self._reject(item, f"it claimed to be rank {hello.sender} but did not prove the job secret")
            return
        sent = self._send(item, ACK.pack(ACK_MAGIC, OK, key.mac(b"A", item.hello_bytes, item.nonce_s, proof,
                                                                  bytes([OK]))))
        if not sent:
            self._reject(item, "it did not take the handshake's acknowledgement")
            return
        if item.key is not None:  # a layout check: its frame comes next, answered here
            item.checking, item.need = True, layout.FRAME.size
            item.expires = time.monotonic() + HANDSHAKE_TIMEOUT_S
            self._pending.append(item)
            return
        item.sock.setblocking(True)
        item.sock.settimeout(None)
        with self._cond:
            if self._closed:
                self._dismiss(hello, item.sock, self._farewell)
                return
            self._ready.append((replace(hello, server_nonce=item.nonce_s), item.sock, item.peer))
            self._cond.notify_all()
        try:
            self._ready_w.send(b"x")
        except OSError:
            pass  # full: it is readable anyway

    def _on_layout(self, item: _Pending, data: bytes) -> None:
        """The connector proved the layout key and sent its view: answer with this rank's, and
        record the connector's when it differs."""
        self._pending.remove(item)
        assert item.hello is not None and item.key is not None and self._check is not None
        session = item.hello.nonce + item.nonce_s
        theirs = layout.read(item.key, b"C", session, data)
        if theirs is None:
            self._reject(item, "its layout frame did not carry the layout key's MAC")
            return
        self._send(item, self._check[0].frame(item.key, b"A", session))
        item.sock.close()
        if not theirs.differs(self._check[0].view):
            return
        log.debug("%s: %s", self._label, layout.describe(self._check[0].view, theirs))
        with self._cond:
            self._conflicts.append((theirs, item.peer))
        try:
            self._ready_w.send(b"x")
        except OSError:
            pass

    @staticmethod
    def _send(item: _Pending, frame: bytes) -> bool:
        """A fresh connection always has room for a frame this small; a peer that does not
        take it is not a rank."""
        try:
            return item.sock.send(frame) == len(frame)
        except OSError:
            return False


_LIVE: "weakref.WeakSet[Acceptor]" = weakref.WeakSet()


@atexit.register
def _stop_listening_at_exit() -> None:
    """An exiting process stops listening before the interpreter winds down. Its acceptor is a
    daemon thread that stops answering once finalization starts while the kernel still accepts
    for it, so a peer's abort notice or liveness probe would wait its whole timeout, as for a
    stopped rank (and a probe would call it stopped). Closed here, the listener refuses: the
    peer sees at once that this rank has left."""
    for acceptor in list(_LIVE):
        acceptor.close()
        for sock in acceptor._listening:
            sock.close()


def _describe(addr) -> str:
    if isinstance(addr, tuple):
        host, port = addr[0], addr[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return "a local process (Unix socket)"

