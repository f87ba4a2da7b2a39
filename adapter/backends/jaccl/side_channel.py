"""JACCL's side channel: a star of TCP connections around rank 0 at MLX_JACCL_COORDINATOR.

It carries only set-up traffic: each rank's connection details (queue pair numbers and GIDs for
verbs, a listening ip:port for the TCP mesh) are all-gathered through rank 0, and an all-gather
of nothing is a barrier. Every frame is length-prefixed and every wait has a deadline.

When rank 0 gives up (a rank never connected by the deadline), it sends every connected rank an
abort frame with its reason, so they fail naming the missing rank instead of timing out on
rank 0; they wait ABORT_GRACE_S past the deadline for that verdict.

Ranks whose device files differ (another world size, other cells) have different job contexts,
so rank 0 refuses their side-channel connections as another job's. With a job secret, such a
rank asks rank 0's listener for its layout (transport/layout.py, under the secret's key at the
coordinator's address): when the layouts differ, it raises a ConfigError naming both views, and
rank 0's acceptor records the other view, so rank 0 raises the same ConfigError and passes it on
in a layout abort frame to every rank of its own view, and for LAYOUT_STAY_S more to those still
on their way (as the ring does, ring/forming.py).

Since every rank is connected to rank 0, the side channel also watches the rest of the formation
(watch()): rank 0 sees any rank die (its connection ends) and aborts the others; a rank sees an
abort from rank 0, or rank 0's own death.

Every connection proves the job key (tcp.connect / Listener), and every length field is
bounded by what the protocol sends: MAX_BLOB_BYTES per rank's blob, MAX_ABORT_BYTES of reason.
"""
from __future__ import annotations

import select
import socket
import struct
import time
from typing import Callable

from ...errors import ABORT, ConfigError, DistributedError, PeerError, blaming, failure_of, with_failure
from ..transport import layout, tcp
from . import knock

PURPOSE_SIDE_CHANNEL = 0x4A43  # "JC": rejects connections meant for other backends
_LEN = struct.Struct("<I")
_ABORT = 0xFFFFFFFF            # in place of a length: an abort frame (culprit + 1, text length, text) follows
_LAYOUT_ABORT = 0xFFFFFFFE     # the same, for a layout mismatch: the receiver raises LayoutMismatch
LAYOUT_STAY_S = 2.0            # rank 0, after a layout mismatch: how long ranks on their way are still told
LAYOUT_CHECK_S = 0.5           # a rank refused as another job asks rank 0 for its layout at most this often
LAYOUT_ANSWER_S = 0.5          # ... and waits this long for the answer
ABORT_GRACE_S = 1.0
LATECOMER_GRACE_S = 5.0        # rank 0, after a death: how long ranks still on their way get the verdict
_ABORT_SEND_S = 0.5
MAX_BLOB_BYTES = 1 << 16       # a rank's connection details: a few hundred bytes in practice
MAX_ABORT_BYTES = 60000


class _Died(PeerError):
    """Rank 0 saw a rank's side-channel connection end while the group formed."""


class LayoutMismatch(ConfigError):
    """Two JACCL ranks hold different layouts (MLX_IBV_DEVICES, MLX_JACCL_COORDINATOR): a
    ConfigError on the rank that found it and on every rank it told. culprit: the rank of the
    other view, as the reporter numbers it."""

    def __init__(self, text: str, culprit: int) -> None:
        super().__init__(text)
        if culprit >= 0:
            with_failure(self, culprit=culprit, how=ABORT)


class SideChannel:
    """all_gather(bytes) -> list[bytes] in rank order, and barrier(), among `size` ranks."""

    def __init__(self, rank: int, size: int, coordinator: tuple[str, int], token: int,
                 deadline: float, job: tcp.Auth, check: layout.Check | None = None,
                 peer_host: Callable[[int, str], None] | None = None,
                 keep: "Callable[[tcp.Listener], None] | None" = None) -> None:
        self.rank = rank
        self.size = size
        self.coordinator = coordinator
        self._peers: dict[int, socket.socket] = {}
        self._deadline = deadline
        self._check = check  # this rank's layout, compared with a rank 0 that answers as another job
        self._checked_at = 0.0
        self._peer_host = peer_host  # rank 0: told each rank's host as it arrives (may refuse it)
        where = self._where = tcp.format_address(coordinator)
        if rank == 0:
            # The address this process held since a group formed here before (knock.hold), else a new one.
            listener = knock.take_held(where) or tcp.Listener(coordinator[0], coordinator[1], local=False)
            kept = False
            listener.reserve(job, token, 0,
                           lambda h: None if h.purpose == PURPOSE_SIDE_CHANNEL and 0 < h.sender < size
                           and h.channel == 0 else f"not a side-channel connection of ranks 1..{size - 1}",
                           "rank 0 (JACCL side channel)", check=None if check is None else (check, where))
            try:
                self._gather_ranks(listener, deadline)
                if keep is not None:  # the group keeps the address for its grows (knock.hold)
                    keep(listener)
                    kept = True
            except LayoutMismatch as exc:
                self.abort(str(exc), culprit=exc.culprit, mismatch=True)
                self._tell_latecomers(listener, str(exc), exc.culprit, LAYOUT_STAY_S, mismatch=True)
                self.close()
                raise
            except ConfigError as exc:  # a rank on another host without a secret (open_hosts.py)
                self.abort(str(exc))
                self.close()
                raise
            except PeerError as exc:
                culprit = failure_of(exc).culprit
                self.abort(str(exc), culprit=culprit)
                if not isinstance(exc, _Died):
                    self.close()
                    raise
                self._tell_latecomers(listener, str(exc), culprit)
                self.close()
                raise blaming(PeerError(str(exc)), culprit) from None
            finally:
                if not kept:
                    listener.close()
        else:
            hello = tcp.Hello(PURPOSE_SIDE_CHANNEL, rank, 0, 0, token)
            try:
                self._peers[0] = tcp.connect_with_hello(coordinator, hello, deadline,
                                                        f"JACCL coordinator (rank 0, MLX_JACCL_COORDINATOR={where})",
                                                        job, other_job=self._compare_layout)[0]
            except PeerError as exc:
                raise blaming(exc, 0) from None  # unreachable, as the ring names the neighbour it cannot reach

    def _compare_layout(self) -> None:
        """Rank 0 answered as another job: when it proves the layout key and holds another
        layout, raise LayoutMismatch naming both views (at most every LAYOUT_CHECK_S)."""
        now = time.monotonic()
        if self._check is None or now < self._checked_at + LAYOUT_CHECK_S:
            return
        self._checked_at = now
        theirs = tcp.ask_layout(self._check, self._where, 0, now + LAYOUT_ANSWER_S)
        if theirs is not None and theirs.differs(self._check.view):
            raise self._mismatch(theirs)

    def _mismatch(self, theirs: layout.View) -> LayoutMismatch:
        mine = self._check.view  # type: ignore[union-attr]
        return LayoutMismatch(f"rank {mine.rank}: the JACCL ranks disagree on the group's layout: "
                              f"{layout.describe(mine, theirs, 'MLX_IBV_DEVICES or coordinator differs')}; "
                              f"give every rank the same MLX_IBV_DEVICES and MLX_JACCL_COORDINATOR", theirs.rank)

    def _gather_ranks(self, listener: tcp.Listener, deadline: float) -> None:
        """Rank 0: take every rank's connection, watching those taken (a death ends this at once)."""
        while len(self._peers) < self.size - 1:
            waiting = sorted(set(range(1, self.size)) - set(self._peers))
            poller = select.poll()
            poller.register(listener.ready_fd(), select.POLLIN)
            for sock in self._peers.values():
                poller.register(sock, select.POLLRDHUP)
            poller.poll(max(0, int((deadline - time.monotonic()) * 1000 + 0.999)))
            listener.drain_ready()
            for theirs, _ in listener.layout_conflicts():
                raise self._mismatch(theirs)
            try:
                self.watch()
            except PeerError as exc:
                raise blaming(_Died(str(exc)), failure_of(exc).culprit) from None
            # Every connection waiting now (one readiness wake-up may stand for several).
            while (taken := listener.take(lambda h: h.sender not in self._peers, time.monotonic(), None)) is not None:
                self._peers[taken[1].sender] = taken[0]
                if self._peer_host is not None:
                    self._peer_host(taken[1].sender, taken[0].getpeername()[0])
            if len(self._peers) < self.size - 1 and time.monotonic() >= deadline:
                try:
                    listener.take(lambda h: h.sender not in self._peers, deadline,
                                  f"JACCL ranks {waiting} (side channel)")
                except PeerError as exc:
                    raise blaming(exc, waiting[0]) from None

    def _tell_latecomers(self, listener: tcp.Listener, reason: str, culprit: int | None,
                         grace: float = LATECOMER_GRACE_S, mismatch: bool = False) -> None:
        """Rank 0, after a death (or a layout mismatch): ranks still on their way get the abort
        too, for `grace` at most (a rank that is not there by then waits for its own deadline).
        Meanwhile its acceptor answers the layout checks of ranks of another view."""
        until = time.monotonic() + grace
        while len(self._peers) < self.size - 1:
            taken = listener.take(lambda h: h.sender not in self._peers, until, None)
            if taken is None:
                return
            self._peers[taken[1].sender] = taken[0]
            self.abort(reason, [taken[1].sender], culprit, mismatch)

    def local_host(self) -> str:
        """The address of this host on the network that reaches the coordinator."""
        if self.rank == 0:
            return self.coordinator[0]
        return self._peers[0].getsockname()[0]

    def _who(self, peer: int) -> str:
        return f"rank {peer} (JACCL side channel, rank {self.rank})"

    def _send(self, peer: int, data: bytes) -> None:
        tcp.send_all(self._peers[peer], _LEN.pack(len(data)) + data, self._deadline, self._who(peer))

    def _recv(self, peer: int) -> bytes:
        # Rank 0 works to the same deadline: give its verdict (an abort frame) time to arrive.
        deadline = self._deadline + (ABORT_GRACE_S if peer == 0 else 0.0)
        try:
            return self._recv_frame(peer, deadline)
        except DistributedError as exc:
            raise blaming(exc, peer)  # silent or gone (an abort frame names its own culprit)

    def _recv_frame(self, peer: int, deadline: float) -> bytes:
        sock, who = self._peers[peer], self._who(peer)
        head = bytearray(_LEN.size)
        tcp.recv_exact(sock, memoryview(head), deadline, who)
        (length,) = _LEN.unpack(head)
        if length in (_ABORT, _LAYOUT_ABORT) and peer == 0:
            tcp.recv_exact(sock, memoryview(head), deadline, who)
            culprit = _LEN.unpack(head)[0] - 1
            tcp.recv_exact(sock, memoryview(head), deadline, who)
            text = bytearray(min(_LEN.unpack(head)[0], MAX_ABORT_BYTES))
            tcp.recv_exact(sock, memoryview(text), deadline, who)
            if length == _LAYOUT_ABORT:
                told = text.decode(errors="replace").split(": ", 1)[-1]
                told = told.replace("; give", " (reported by the JACCL coordinator, rank 0); give", 1)
                raise LayoutMismatch(f"rank {self.rank}: {told}", culprit)
            raise blaming(PeerError(f"rank {self.rank}: the JACCL coordinator (rank 0 at {self._where}) stopped "
                                    f"forming the group: {text.decode(errors='replace')}"),
                          culprit if 0 <= culprit < self.size else 0)
        # Rank 0 sends the whole table (a length and a blob per rank); the others one blob.
        limit = self.size * (_LEN.size + MAX_BLOB_BYTES) if peer == 0 else MAX_BLOB_BYTES
        if length > limit:
            raise PeerError(f"rank {self.rank}: {who} announced a {length}-byte side-channel frame; "
                            f"at most {limit} bytes are legitimate (a corrupted or forged frame)")
        body = bytearray(length)
        tcp.recv_exact(sock, memoryview(body), deadline, who)
        return bytes(body)

    def watch(self) -> None:
        """Raise PeerError when a rank died (rank 0: a side-channel connection ended) or rank 0
        gave up (an abort frame) or died, while the rest of the group forms. Nothing else
        arrives meanwhile: each exchange is answered before the formation moves on."""
        poller = select.poll()
        for sock in self._peers.values():
            poller.register(sock, select.POLLRDHUP if self.rank == 0 else select.POLLIN | select.POLLRDHUP)
        ready = {fd for fd, _ in poller.poll(0)}
        for peer, sock in self._peers.items():
            if sock.fileno() not in ready:
                continue
            if self.rank == 0:
                raise blaming(PeerError(f"rank 0: JACCL rank {peer} died while the group formed (its "
                                        f"side-channel connection to rank 0 closed)"), peer)
            try:
                self._recv(0)  # an abort frame raises, naming the coordinator's reason
            except PeerError as exc:
                if "stopped forming" in str(exc):
                    raise
            raise blaming(PeerError(f"rank {self.rank}: the JACCL coordinator (rank 0 at {self._where}) died "
                                    f"while the group formed (its side-channel connection closed)"), 0)

    def abort(self, reason: str, peers: list[int] | None = None, culprit: int | None = None,
              mismatch: bool = False) -> None:
        """Rank 0 only: tell every connected rank (or those of `peers`) why the group cannot
        form (best effort: a rank that is gone already does not delay the others). mismatch: the
        layouts differ (the receivers raise LayoutMismatch, a ConfigError)."""
        if self.rank != 0:
            return
        text = reason.encode()[:60000]
        # A layout's culprit is numbered by the other view, which may count more ranks.
        limit = MAX_ABORT_BYTES if mismatch else self.size
        blamed = culprit + 1 if culprit is not None and 0 <= culprit < limit else 0  # 0: unknown
        frame = _LEN.pack(_LAYOUT_ABORT if mismatch else _ABORT) + _LEN.pack(blamed) + _LEN.pack(len(text)) + text
        for peer, sock in self._peers.items():
            if peers is not None and peer not in peers:
                continue
            try:
                tcp.send_all(sock, frame, time.monotonic() + _ABORT_SEND_S, self._who(peer))
            except (OSError, DistributedError):
                pass

    def all_gather(self, blob: bytes) -> list[bytes]:
        if len(blob) > MAX_BLOB_BYTES:
            raise ValueError(f"side-channel blob of {len(blob)} bytes exceeds {MAX_BLOB_BYTES}")
        if self.rank != 0:
            self._send(0, blob)
            packed = self._recv(0)
            return _unpack_list(packed, self.size)
        blobs = [blob] + [self._recv(peer) for peer in range(1, self.size)]
        packed = b"".join(_LEN.pack(len(b)) + b for b in blobs)
        for peer in range(1, self.size):
            self._send(peer, packed)
        return blobs

    def barrier(self) -> None:
        self.all_gather(b"")

    def close(self) -> None:
        for sock in self._peers.values():
            try:
                sock.close()
            except OSError:
                pass
        self._peers.clear()


def _unpack_list(packed: bytes, count: int) -> list[bytes]:
    out, offset = [], 0
    for _ in range(count):
        (n,) = _LEN.unpack_from(packed, offset)
        offset += _LEN.size
        out.append(packed[offset:offset + n])
        offset += n
    if len(out) != count or offset != len(packed):
        raise PeerError(f"malformed all-gather reply from the JACCL coordinator (expected {count} entries)")
    return out
