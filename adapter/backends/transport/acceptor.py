"""The acceptor side of the handshake (handshake.py) runs in a thread per listener (Acceptor): connections are accepted as they
come, their handshakes progress side by side without blocking the job, each must finish
within HANDSHAKE_TIMEOUT_S, and at most MAX_PENDING wait at once (the oldest is dropped when a
new one arrives), so a flood of silent connections delays a real peer by at most about that
timeout. Each source (an IP address, or a local uid) may fail HANDSHAKES_PER_S handshakes a
second (a burst of BURST; a handshake that proves the key gives its token back): beyond that its
connections are served on probation, at most MAX_PROBATION at once, the newest dropping the
oldest, so a flood from an address a real peer shares (its host's) cannot crowd the peer out:
the peer proves the key in milliseconds, the flood's connections fail or wait.
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
import threading
import time
import weakref
from dataclasses import replace
from typing import Callable

from . import layout
from .auth import MAC_BYTES, NONCE_BYTES, Auth, equal
from .handshake import (
    ACK,
    ACK_MAGIC,
    ALIVE,
    BAD_PROOF,
    CHALLENGE,
    CHALLENGE_MAGIC,
    HANDSHAKE_TIMEOUT_S,
    MAGIC,
    OK,
    OTHER_JOB,
    PROOF_BYTES,
    PURPOSE_PROBE,
    UNEXPECTED,
    Hello,
    parse_hello,
    peer_uid,
)
from .pending import Pending, describe
from .source_budget import BURST, HANDSHAKES_PER_S, SourceBudget

log = logging.getLogger("jacklring.tcp")

MAX_PENDING = 64             # unfinished handshakes per listener
MAX_LOGGED = 20              # rejections logged one by one per listener; the rest are counted
# A flood of connections from sources over their budget costs the thread an accept() and a
# close() each, under the GIL the job's own threads need. So a listener is served at most
# ACCEPT_BATCH connections per wake-up, and one whose batch closed SHED_TO_PAUSE or more unread
# is not polled for FLOOD_PAUSE_S: the flood waits in the kernel's backlog (or is refused
# there once it is full), which costs the job no GIL. At most ~ACCEPT_BATCH / FLOOD_PAUSE_S
# accepts a second reach Python under a flood; a real peer's connection waits in the backlog
# meanwhile (docs/security.md).
ACCEPT_BATCH = 64
MAX_PROBATION = 16           # handshakes of sources over their budget, per listener at once
PROBATION_PER_S = 50.0       # ... and per second (beyond: the listener rests FLOOD_PAUSE_S)
SHED_TO_PAUSE = 16
FLOOD_PAUSE_S = 0.05

# None: welcome; else why it is refused, or (a handshake status, why) for another status than UNEXPECTED
Admit = Callable[[Hello], "str | tuple[int, str] | None"]


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
        self._pending: list[Pending] = []
        # The connection whose acknowledgement is being sent: out of _pending, not yet in _ready,
        # but the connector may already have it (and go on, and leave): still arriving.
        self._acking: Pending | None = None
        self._ready: list[tuple[Hello, socket.socket, str]] = []
        self._cond = threading.Condition()
        self._rejected = 0
        self._rejected_from: list[str] = []
        self._budget = SourceBudget()
        # probation handshakes (of sources over budget) this listener serves per second, all sources together
        self._probation = SourceBudget(PROBATION_PER_S, int(PROBATION_PER_S))
        self._shed = 0   # connections closed unread: their source was over its handshake budget
        self._paused: dict[int, float] = {}  # listening fd -> when it is polled again (a flood)
        self._probation_spent = False
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

    def _reject(self, item: Pending, why: str, status: int | None = None) -> None:
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
            timeout = min([*(p.expires for p in self._pending), *self._paused.values()], default=now + 1.0) - now
            # poll, not select: a process with many open files has descriptors above 1024
            poller = select.poll()
            by_fd: dict[int, object] = {}
            for s in (*self._listening, self._wake_r):
                if self._paused.get(s.fileno(), 0.0) > now:
                    continue  # flooded: left in the kernel's backlog for now
                self._paused.pop(s.fileno(), None)
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
                if isinstance(target, Pending):
                    if target in self._pending:
                        self._progress(target)
                elif target is not None and target is not self._wake_r:
                    self._accept_all(target)  # type: ignore[arg-type]

    def _accept_all(self, listening: socket.socket) -> None:
        shed_before = self._shed
        for _ in range(ACCEPT_BATCH):
            if not self._accept_one(listening):
                break
        if self._shed - shed_before >= SHED_TO_PAUSE or self._probation_spent:
            self._probation_spent = False
            self._paused[listening.fileno()] = time.monotonic() + FLOOD_PAUSE_S

    def _accept_one(self, listening: socket.socket) -> bool:
        """Accept one connection; False when none was waiting or the listener cannot accept now."""
        try:
            sock, addr = listening.accept()
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            if exc.errno in (errno.ECONNABORTED, errno.EMFILE, errno.ENFILE, errno.ENOBUFS):
                return False
            raise
        uid = peer_uid(sock) if sock.family == socket.AF_UNIX else None
        source = ("uid", uid) if sock.family == socket.AF_UNIX else (addr[0] if isinstance(addr, tuple) else addr)
        over = not self._budget.take(source)
        if over:
            # Over budget: served on probation, never refused outright, or a flood from a host's
            # address (which its ranks share) would decide whose connections get through. A real
            # peer proves the key in milliseconds; a flood's connections fail (and spend the
            # budget) or wait, and the newest probation takes the slot of the oldest.
            self._shed += 1
            if self._shed == 1:
                log.warning("%s: %s opens more than %g failing connections per second (burst %d) on %s: the "
                            "excess is served on probation (at most %d at once, the oldest dropped)", self._label,
                            describe(addr), HANDSHAKES_PER_S, BURST, self._where, MAX_PROBATION)
            # More than PROBATION_PER_S: this one is served, then the listener rests (the rest
            # wait in the kernel's backlog, not refused), which bounds what a flood of
            # handshakes costs the job's CPU.
            self._probation_spent = self._probation_spent or not self._probation.take(None)
            on_probation = [p for p in self._pending if p.probation]
            if len(on_probation) >= MAX_PROBATION:
                self._pending.remove(on_probation[0])
                on_probation[0].sock.close()  # not logged: a flood's
        item = Pending(sock, describe(addr), time.monotonic() + HANDSHAKE_TIMEOUT_S, source, over)
        if sock.family == socket.AF_UNIX and uid != os.getuid():
            self._reject(item, f"the local process belongs to uid {uid}, not this job's user")
            return True
        sock.setblocking(False)
        self._pending.append(item)
        if len(self._pending) > MAX_PENDING:
            oldest = self._pending.pop(0)  # (probation has its own cap: these are in budget)
            self._reject(oldest, f"more than {MAX_PENDING} connections were waiting to finish a handshake")
        return True

    def _progress(self, item: Pending) -> None:
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

    def _on_hello(self, item: Pending, data: bytes) -> None:
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
            return why if isinstance(why, tuple) else (UNEXPECTED, why)
        return None

    def _on_proof(self, item: Pending, proof: bytes) -> None:
        self._pending.remove(item)
        self._acking = item
        try:
            self._acknowledge(item, proof)
        finally:
            self._acking = None

    def _acknowledge(self, item: Pending, proof: bytes) -> None:
        hello = item.hello
        assert hello is not None
        key = item.key or self._auth
        if not equal(proof, key.mac(b"C", item.hello_bytes, item.nonce_s)):
            # The refusal carries no MAC: nothing an outsider could test a guess of the key against.
            self._send(item, ACK.pack(ACK_MAGIC, BAD_PROOF, bytes(MAC_BYTES)))
            self._reject(item, f"it claimed to be rank {hello.sender} but did not prove the job secret")
            return
        if not item.probation:
            self._budget.refund(item.source)  # only failed handshakes spend a source's budget
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

    def _on_layout(self, item: Pending, data: bytes) -> None:
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
    def _send(item: Pending, frame: bytes) -> bool:
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
