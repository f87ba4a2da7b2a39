"""Forming a ring: who may connect to a rank's listeners, connecting both neighbours (watched
for a death or an abort, formation.py), init's closing barrier, and the verdict a rank that gives
up passes on. The words an abort is put in (Wording) are the group's own formation's, or a
split's parent's for its sub-groups (splitting.py)."""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable

from ... import config
from ...errors import CollectiveTimeout, DistributedError, PeerError, failure_of
from ..transport import blame, integrity, layout, tcp
from ..transport.auth import Auth
from ..transport.stream_engine import Engine, Stream
from . import origin, standby
from .addresses import links_per_neighbour, ranks_on_this_host
from .formation import FormationAbandoned, LayoutMismatch, Watch
from .header import (
    ABORT_DIED,
    ABORT_MISSING,
    HEADER,
    HEADER_MAGIC,
    OP_ABORT,
    PURPOSE_ABORT,
    PURPOSE_P2P,
    PURPOSE_RING,
    PURPOSE_SHRINK,
    admits_shrink,
    find_abort,
)
from .state import RingState

log = logging.getLogger("jacklring.ring")

GONE_AFTER_S = 1.0  # a decided member's address refusing connections this long: it has left (see decided)
LEFT_PROBE_S = 0.25  # how often a rank waiting for its left neighbour probes that neighbour's listener
LEFT_PROBE_ANSWER_S = 0.1  # ... and how long the answer may take (no answer: no conclusion)
CANNOT_LISTEN_NOTICE_S = 2.0  # how long a rank that cannot listen at its address tries to tell each neighbour
ABORT_NOTICE_S = 1.0  # how long a rank that gave up tries to reach a neighbour it had no connection with
ABORT_NOTICE_HOLD_S = 0.25  # ... of which its error waits at most this long past the connect deadline (the
                            # rest goes on in the background: every init error within deadline + 0.5 s)
LAYOUT_CHECK_S = 1.0  # a listener that answers as another job is asked for its layout at most this often
LAYOUT_ANSWER_S = 0.5  # ... and how long its answer may take (no answer: no conclusion)
LAYOUT_LINGER_S = 2.0  # a rank that found (or was told of) a layout mismatch stays to tell late starters
VERDICT_GRACE_S = 0.05  # the closing barrier of init() waits this long past the connect deadline
                        # (a neighbour's verdict sent at that deadline comes first), then probes
                        # who is silent (plumbing.Plumbing._unresponsive_member, within 0.5 s)


class Wording:
    """What an abort header is about and how its members are named: the group's own formation,
    until a split's parent rewords them for the sub-groups (splitting.py)."""

    def __init__(self, state: RingState) -> None:
        self._state = state
        self.describe_member: Callable[[int], str] = lambda p: f"rank {p}"  # a split names both numberings
        self.task, self.forming, self.member_word = "forming the group", "the group", "rank"
        self.abandoned: type[FormationAbandoned] = FormationAbandoned
        # While a split forms this sub-ring, an abort header read here names parent ranks: word
        # it as the parent's watch does (None once formed, or for a ring of its own).
        self.formation_text: Callable[[int, int, bool], str] | None = None

    def abort_header(self, culprit: int, missing: bool = False) -> bytes:
        return HEADER.pack(HEADER_MAGIC, OP_ABORT, ABORT_MISSING if missing else ABORT_DIED, self._state.rank, 0,
                           culprit)

    def abort_text(self, reporter: int, culprit: int, missing: bool = False) -> str:
        if missing:
            who = self._state.who(culprit) if self.task == "forming the group" else self.describe_member(culprit)
            return f"{who} did not connect before the deadline (reported by {self.member_word} {reporter})"
        if culprit == reporter:
            return f"{self.describe_member(reporter)} gave up {self.task} after an error of its own"
        if culprit < 0:
            return f"{self.describe_member(reporter)} gave up {self.task}"
        return (f"{self.describe_member(culprit)} died or gave up while {self.forming} formed "
                f"(reported by {self.member_word} {reporter})")


def admit(state: RingState, hello: tcp.Hello, listener: int, k: int) -> str | None:
    """Who may connect to this rank's listener number `listener`: the left neighbour's ring
    connection of that number, and (on the first) any other rank's point-to-point stream."""
    rank, size = state.rank, state.size
    prv = (rank - 1) % size
    if hello.purpose == PURPOSE_RING:
        if hello.sender == prv and hello.channel == listener < k:
            return None
        return f"ring connection {listener} is for rank {prv}"
    if hello.purpose == origin.PURPOSE_NOTICE and listener == 0:
        return None if origin.admits(hello.sender, rank, size) else f"no rank {hello.sender} here"
    if hello.purpose == standby.PURPOSE_STANDBY and listener == 0:
        return None if standby.admits(hello.sender, rank, size) else f"no rank {hello.sender} here"
    if hello.purpose == PURPOSE_P2P and listener == 0:
        if 0 <= hello.sender < size and hello.sender != rank and hello.channel == 0:
            return None
        return f"no rank {hello.sender} sends point-to-point here"
    if hello.purpose == PURPOSE_SHRINK and listener == 0:
        return admits_shrink(hello.sender, rank, size)
    if hello.purpose == PURPOSE_ABORT and listener == 0:
        if hello.sender in (prv, (rank + 1) % size) and hello.channel == 0:
            return None
        return f"rank {hello.sender} is not a ring neighbour"
    return f"unknown purpose {hello.purpose:#x}"


def send_abort_notice(address: str, hello: tcp.Hello, keys: Auth, notice: bytes, until: float,
                      other_job: Callable[[], None]) -> None:
    """Connect to a ring neighbour's `address` (an abort notice's hello) until `until` and write
    `notice`; nothing when it does not answer in time (it then waits for its own deadline) or
    answers as another job and other_job raises. Never raises: it runs on a thread of its own."""
    try:
        sock = tcp.connect_with_hello(tcp.parse_address(address), hello, until, f"rank {hello.receiver}", keys,
                                      other_job=other_job)[0]
    except Exception:
        return
    try:
        sock.settimeout(max(0.01, until - time.monotonic()))
        sock.sendall(notice)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        sock.close()


def tell_cannot_listen(rank: int, addresses: list[list[str]], token: int, keys: Auth, seconds: float) -> None:
    """This rank cannot listen at its own address (another process holds the port: a collision
    with another job, or the rank it replaces still runs), so it takes no part in forming the
    ring. Its neighbours would wait for it until their connect deadline (the left one connecting
    to whatever holds that address), so it tells both at once, for up to `seconds` each (they
    may not listen yet): an abort notice naming this rank, as a rank that gave up after an error
    of its own; they pass it on around the ring."""
    size = len(addresses)
    header = HEADER.pack(HEADER_MAGIC, OP_ABORT, ABORT_DIED, rank, 0, rank)
    until = time.monotonic() + seconds

    def other_job() -> None:
        raise PeerError("it answers as another job")  # not this ring's rank: nothing to tell

    def tell(peer: int) -> None:
        send_abort_notice(addresses[peer][0], tcp.Hello(PURPOSE_ABORT, rank, peer, 0, token), keys, header, until,
                          other_job)

    tellers = [threading.Thread(target=tell, args=(peer,), daemon=True, name=f"jacklring-tell rank {peer}")
               for peer in sorted({(rank + 1) % size, (rank - 1) % size} - {rank})]
    for t in tellers:
        t.start()
    for t in tellers:
        t.join(max(0.0, until - time.monotonic()) + 1.0)


def abandon(state: RingState, words: Wording, culprit: int, missing: bool = False, frame: bytes | None = None) -> None:
    """Tell both ring neighbours (who tell theirs) that the split (or, in init's closing
    barrier, the formation) failed and why (or send frame, a layout abort), then stop writing:
    each neighbour's poll wakes on the end of the stream, so the news crosses a hop as soon as
    it arrives."""
    abort = frame or words.abort_header(culprit, missing)
    for link in state.right + state.left:
        try:
            link.sock.send(abort, socket.MSG_DONTWAIT)
            link.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    what = "a split of this group" if words.task == "the split" else "forming this group"
    state.failure.mark(f"rank {state.rank}: {what} failed")


class Forming:
    """One ring's formation: its watch (its own, or a split's over the parent's links), how the
    watch names members (a split's: by parent rank), and the connect deadline."""

    def __init__(self, state: RingState, words: Wording, watch: Watch | None,
                 parent_ranks: list[int] | None, peers_listening: bool = False,
                 check: layout.Check | None = None, decided: bool = False) -> None:
        self._state = state
        # This rank's layout, compared with a listener that answers as another job (layout.py):
        # only for a ring formed from the hostfile with a job secret.
        self._check = check
        self._checked: dict[str, float] = {}  # address -> when its layout was last asked for
        # Every address came from a record its rank published while already listening there (a
        # store rendezvous), so a refused connection means that rank has left, not "not yet up".
        self._peers_listening = peers_listening
        # The addresses come from a decision (shrink's, grow's): every member listened at them
        # before it was made and keeps listening until it forms or gives up, so a right
        # neighbour whose address refuses every connection for GONE_AFTER_S has died or given
        # up: it is named then, not at the connect deadline.
        self._gone_after = GONE_AFTER_S if decided else None
        self._words = words
        # A split's watch names members by their parent rank (parent_ranks[sub-group rank]).
        self._watched_rank: Callable[[int], int] = (lambda p: p) if parent_ranks is None else parent_ranks.__getitem__
        words.formation_text = watch.explain if watch is not None else None
        # A split passes the watch over its parent's links; init watches this ring's own.
        self.watch = watch if watch is not None else Watch(
            find_abort, words.abort_header, words.abort_text, words.describe_member, words.forming,
            prefix=f"rank {state.rank}: ")
        self.own = watch is None
        self._gave_up = False
        self._deadline = 0.0

    def connect(self) -> None:
        """Connect to the right neighbour and take the left one's connections (state.right,
        state.left and state.engine once both are complete)."""
        state = self._state
        n, r = state.size, state.rank
        nxt, prv = (r + 1) % n, (r - 1) % n
        k = links_per_neighbour(state.addresses)
        deadline = self._deadline = time.monotonic() + state.connect_timeout
        watch = self.watch
        as_watched = self._watched_rank
        listeners = state.listeners
        right: list = []
        left_socks: list[socket.socket | None] = [None] * k
        left_hellos: list = [None] * k  # their handshakes: the nonces key each connection's trailers
        aborts: list[socket.socket] = []

        def arrivals() -> None:
            """Take the left neighbour's connections (and abort notices) as they arrive, so they
            are watched while this rank still connects to the right."""
            now = time.monotonic()
            for c in range(k):
                if left_socks[c] is None:
                    taken = listeners[c].take(lambda h: h.purpose == PURPOSE_RING, now, None)
                    if taken is not None:
                        left_socks[c], left_hellos[c] = taken
                        watch.add(taken[0], as_watched(prv))
            while (taken := listeners[0].take(lambda h: h.purpose == PURPOSE_ABORT, now, None)) is not None:
                aborts.append(taken[0])
                watch.add(taken[0], taken[1].sender)
            if self._check is not None:
                for listener in listeners:
                    for theirs, _ in listener.layout_conflicts():
                        raise self._mismatch(theirs)

        watch.wake_on(listeners, arrivals,
                      lambda p: (p == as_watched(nxt) and len(right) < k) or (p == as_watched(prv) and None in left_socks))
        # A decided member listened at its address before the decision and keeps listening until
        # it forms or gives up: refusals for GONE_AFTER_S mean it left, as for the right neighbour
        # (before, a left neighbour that died after the decision was named at the deadline).
        left_seen = [self._peers_listening or self._gone_after is not None]
        gone_since: list[float | None] = [None]

        def probe_left() -> None:
            """A left neighbour whose listener answered (or was published listening) and now
            refuses died before it connected here (a rank merely slow to start never answered:
            it still has the deadline)."""
            if None not in left_socks or prv == r:
                return
            verdict = blame.answers(state.addresses[prv][0], state.token, r, prv,
                                    time.monotonic() + LEFT_PROBE_ANSWER_S)
            if verdict != blame.GONE:
                gone_since[0] = None
            if verdict == blame.ALIVE_:
                left_seen[0] = True
            elif verdict == blame.GONE and left_seen[0] and self._gone_after is not None and (
                    gone_since[0] is None or time.monotonic() - gone_since[0] < self._gone_after):
                gone_since[0] = gone_since[0] or time.monotonic()  # decided: name it after GONE_AFTER_S
            elif verdict == blame.GONE and left_seen[0]:
                arrivals()
                watch.check()  # if it gave up, its abort (sent before it left) says why
                seen = ("it published its record listening" if self._peers_listening else
                        f"it listened when the decision was made, and refused connections for {self._gone_after:g} s"
                        if self._gone_after is not None else "its listener answered")
                raise watch.died(as_watched(prv), f"{seen}, then refused connections before it connected to "
                                                  f"this rank")
            elif verdict == blame.GONE:  # never answered as this group's: perhaps another layout
                self._compare_layout(state.addresses[prv][0], prv)
        watch.every(LEFT_PROBE_S, probe_left)
        try:
            for c in range(k):
                sock, hello = self._connect_right(nxt, c, deadline)
                watch.add(sock, as_watched(nxt))
                right.append(Stream(sock, nxt, state.who(nxt, c), integrity.for_link(
                    state.verify, state.auth, state.token, r, nxt, f"ring {r}->{nxt} #{c}", hello.session)))
            watch.wait(deadline, lambda: None not in left_socks)
            for c in range(k):
                if left_socks[c] is None:  # the deadline: the listener's error names what is missing
                    try:
                        left_socks[c], left_hellos[c] = listeners[c].take(
                            lambda h: h.purpose == PURPOSE_RING, deadline, f"rank {r}: rank {prv} (connection {c} of {k})")
                    except PeerError as exc:
                        exc.missing_rank, exc.about_rank = as_watched(prv), prv  # type: ignore[attr-defined]
                        raise
            left = [Stream(sock, prv, state.who(prv, c), integrity.for_link(
                state.verify, state.auth, state.token, r, prv, f"ring {prv}->{r} #{c}", left_hellos[c].session))
                for c, sock in enumerate(left_socks)]
        except BaseException as exc:
            try:
                arrivals()  # queued while a handshake blocked: they must hear the verdict too
            except Exception:
                pass
            self.give_up(exc, tell_unlinked=self.own)  # before the connections close
            for item in right:
                item.close()
            for sock in left_socks:
                if sock is not None:
                    sock.close()
            raise
        finally:
            watch.wake_on([], None)
            watch.every(0.0, None)
            for sock in aborts:
                sock.close()
        state.right, state.left = right, left
        state.engine = Engine(right + left, r)
        state.engine.stall_report_s = config.get("JACKLRING_STALL_REPORT")
        state.engine.spin_s = tcp.spin_seconds(ranks_on_this_host(state.addresses, r))
        log.debug("rank %d: ring connected (%d connection(s) to rank %d and from rank %d)", r, k, nxt, prv)

    def _connect_right(self, nxt: int, c: int, deadline: float) -> tuple[socket.socket, tcp.Hello]:
        """Connect ring connection c to the right neighbour; the handshake's acknowledgement
        means the neighbour took it. Between attempts the formation's watch sleeps in poll() on the
        connections that can bring news of a death (see formation.py)."""
        state = self._state
        addr = tcp.parse_address(state.addresses[nxt][c])
        hello = tcp.Hello(PURPOSE_RING, state.rank, nxt, c, state.token)
        self.watch.check()
        try:
            return tcp.connect_with_hello(addr, hello, deadline, f"rank {nxt}", state.auth,
                                          pause=self.watch.pause,
                                          other_job=lambda: self._compare_layout(state.addresses[nxt][c], nxt),
                                          gone_after=self._gone_after)
        except FormationAbandoned:
            raise
        except tcp.PeerGone as exc:
            error = PeerError(f"rank {state.rank}: {exc}")
            error.about_rank = nxt  # type: ignore[attr-defined]
            error.missing_rank = self._watched_rank(nxt)  # type: ignore[attr-defined]
            raise error from None
        except PeerError as exc:
            error = PeerError(f"rank {state.rank}: {exc}")
            error.about_rank = nxt  # type: ignore[attr-defined]
            if time.monotonic() >= deadline:
                error.missing_rank = self._watched_rank(nxt)  # type: ignore[attr-defined]
            raise error from None

    def _compare_layout(self, address: str, peer: int) -> None:
        """The listener at address answered as another job: when it proves the layout key and
        holds another layout, raise LayoutMismatch naming both views (at most every
        LAYOUT_CHECK_S per address; without a layout check, nothing)."""
        if self._check is None:
            return
        now = time.monotonic()
        if now < self._checked.get(address, 0.0) + LAYOUT_CHECK_S:
            return
        self._checked[address] = now
        theirs = tcp.ask_layout(self._check, address, peer, now + LAYOUT_ANSWER_S)
        if theirs is not None and theirs.differs(self._check.view):
            raise self._mismatch(theirs)

    def _mismatch(self, theirs: layout.View) -> LayoutMismatch:
        mine = self._check.view  # type: ignore[union-attr]
        return LayoutMismatch(f"rank {mine.rank}: the ranks disagree on the group's layout: "
                              f"{layout.describe(mine, theirs)}; give every rank the same hostfile",
                              mine.rank, theirs.rank, theirs.size, mine.size)

    def finish(self, barrier: Callable[[], None]) -> None:
        """A closing barrier: no rank leaves init() before every rank has connected, and a rank
        whose barrier fails passes the verdict on over the ring (see plumbing.Plumbing.collective)."""
        state = self._state
        state.abandon_on_failure = True
        # A little past the connect deadline: a neighbour's verdict on a missing rank (sent at
        # that deadline) arrives first, so this rank names it instead of the neighbour.
        op_timeout, state.timeout = state.timeout, max(0.001, self._deadline - time.monotonic()) + VERDICT_GRACE_S
        seq = state.seq
        try:
            barrier()  # waits for the slowest rank's formation: the connect deadline bounds it
            state.seq = seq  # formation traffic: the caller's operations keep their numbers (seq 1 first)
        except FormationAbandoned:
            raise
        except DistributedError as exc:
            failure = failure_of(exc)
            peer = -1 if failure.peer is None else failure.peer
            # A member whose listener did not answer (plumbing), or past the grace the rank this
            # one waited for: it said nothing at all.
            silent = failure.culprit if isinstance(exc, CollectiveTimeout) else None
            waited = failure.waiting_on
            if silent is None and peer < 0 and waited:
                silent = waited[0]
            if silent is not None and silent >= 0:
                raise FormationAbandoned(silent, f"rank {state.rank}: {self._words.describe_member(silent)} "
                                                 f"went silent while the group formed (the closing barrier "
                                                 f"failed: {exc})") from None
            if peer < 0:
                raise
            raise FormationAbandoned(peer, f"rank {state.rank}: {self._words.describe_member(peer)} died while the "
                                           f"group formed (the closing barrier failed: {exc})") from None
        finally:
            state.abandon_on_failure = False
            state.timeout = op_timeout

    def give_up(self, exc: BaseException, tell_unlinked: bool) -> None:
        """A formation failed here: pass the verdict on before the connections close (so the
        others read an abort naming the culprit, not just a closed connection). Once."""
        if self._gave_up:
            return
        self._gave_up = True
        state = self._state
        culprit = exc.culprit if isinstance(exc, FormationAbandoned) else getattr(exc, "missing_rank", -1)
        missing = exc.missing if isinstance(exc, FormationAbandoned) else culprit >= 0
        frame = exc.frame() if isinstance(exc, LayoutMismatch) else None
        if culprit < 0:
            try:
                self.watch.check()  # a failure here is often the echo of a death elsewhere
            except FormationAbandoned as cause:
                culprit, missing = cause.culprit, cause.missing
                frame = cause.frame() if isinstance(cause, LayoutMismatch) else None
        sent = self.watch.abandon(culprit, missing, frame)
        # A left neighbour's ring connection that this rank's listener acknowledged but this
        # formation did not take yet (the acceptor queued it after the last look, or while this
        # rank gave up) is made, for that neighbour: it watches it, and a bare close there would
        # name this rank. It is closed with the same verdict.
        for listener in state.listeners:
            listener.farewell(sent, lambda hello: hello.purpose == PURPOSE_RING)
        if not tell_unlinked or state.size < 2:
            return
        # A ring neighbour this rank has no connection with yet would wait for its deadline (not
        # the one this failure is about: it is missing, or something else answers at its address).
        # Both are told at once, each on a thread: for up to ABORT_NOTICE_S (a neighbour whose
        # listener comes up within it is still told), but the error waits for them only until
        # ABORT_NOTICE_HOLD_S past the connect deadline; the threads are not daemons, so a process
        # that exits on the error still finishes them (bounded by ABORT_NOTICE_S).
        now = time.monotonic()
        until = now + ABORT_NOTICE_S
        hold = min(until, max(now, self._deadline) + ABORT_NOTICE_HOLD_S)
        skip = {culprit, state.rank, getattr(exc, "about_rank", -1)}
        notice = frame or self._words.abort_header(culprit, missing)
        threads = []
        for peer in sorted({(state.rank + 1) % state.size, (state.rank - 1) % state.size} - skip):
            if self.watch.linked(peer):
                continue
            thread = threading.Thread(target=self._notify, args=(peer, notice, frame is not None, until),
                                      name=f"jacklring-abort-notice-{state.rank}-{peer}")
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(max(0.0, hold - time.monotonic()))
        if frame is not None:
            self._linger(frame)

    def _notify(self, peer: int, notice: bytes, layout_frame: bool, until: float) -> None:
        """Pass a formation's verdict to ring neighbour `peer`, which this rank has no connection
        with, trying until `until` (on a thread of give_up: never raises)."""
        state = self._state

        def other_view() -> None:
            """After a layout mismatch a neighbour that answers as another job holds the other
            view: it cannot take this notice (it learns from its own check), so do not retry."""
            if layout_frame:
                raise PeerError("it answers as another job")
        send_abort_notice(state.addresses[peer][0], tcp.Hello(PURPOSE_ABORT, state.rank, peer, 0, state.token),
                          state.auth, notice, until, other_view)

    def _linger(self, frame: bytes) -> None:
        """After a layout mismatch, for LAYOUT_LINGER_S: answer every connection that arrives
        (a rank that started late) with the layout abort, while the acceptor thread answers
        layout checks. Without it a rank that starts after the others gave up has nobody left
        to tell it (or to compare with) and waits for its connect deadline."""
        listeners = self._state.listeners
        until = time.monotonic() + LAYOUT_LINGER_S
        while time.monotonic() < until:
            for listener in listeners:
                while (taken := listener.take(lambda h: True, time.monotonic(), None)) is not None:
                    sock = taken[0]
                    try:
                        sock.send(frame, socket.MSG_DONTWAIT)
                        sock.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    finally:
                        sock.close()
            time.sleep(0.02)
