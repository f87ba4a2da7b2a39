"""Forming a ring without waiting out the connect deadline when a member dies or gives up.

While a ring forms (init, or the sub-rings of a split), every wait of the formation sleeps in
poll() on the sockets that can bring news: the connections of this ring made so far, a split's
parent links, and the listeners' queues of authenticated arrivals (taken as they come, so they
are watched too). A watched connection that ends means its member died; one that carries an
abort header before it ends means that member gave up, naming the member it blames. Either way
this rank raises at once and passes an abort on over every connection it has, so the news
crosses each hop as soon as it arrives (no poll period).

A member nobody has heard from (no connection to or from it yet) cannot be told apart from one
that has not started yet: for it the connect deadline (JACKLRING_CONNECT_TIMEOUT) still applies.
Except the left neighbour, which a rank waits for: its listener is probed every LEFT_PROBE_S
(forming.py), and one that answered and later refuses connections died (a live member's
listener stays open while it forms; one that gives up says so first, and that is read first).
"""
from __future__ import annotations

import select
import socket
import time
from typing import Callable

from ...errors import ABORT, ConfigError, PeerError, with_failure
from ..transport import tcp
from .header import find_layout_abort, layout_abort_header

ENDED = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL


class FormationAbandoned(PeerError):
    """A group stopped forming because `culprit` (a rank, or -1 when unknown) died or gave up,
    or (missing) never connected before the connect deadline."""

    def __init__(self, culprit: int, text: str, missing: bool = False) -> None:
        super().__init__(text)
        with_failure(self, culprit=culprit, how=ABORT)
        self.missing = missing




class LayoutMismatch(FormationAbandoned, ConfigError):
    """The formation stopped because two ranks hold different layouts (layout.py): `culprit`
    (as the reporter numbers it) believes the world has culprit_size ranks, `reporter` believes
    reporter_size. A ConfigError on every rank: the one that found it, and those it told."""

    def __init__(self, text: str, reporter: int, culprit: int, culprit_size: int, reporter_size: int) -> None:
        super().__init__(culprit, text)
        self.reporter, self.culprit_size, self.reporter_size = reporter, culprit_size, reporter_size

    def frame(self) -> bytes:
        """The abort header that passes this on (the same words on every rank it reaches)."""
        return layout_abort_header(self.reporter, self.culprit, self.culprit_size, self.reporter_size)


def layout_told(prefix: str, found: tuple[int, int, int, int]) -> LayoutMismatch:
    """The error of a rank told by an abort header (find_layout_abort) that two layouts differ."""
    reporter, culprit, culprit_size, reporter_size = found
    if culprit_size != reporter_size:
        what = f"rank {culprit} believes the world has {culprit_size} ranks, rank {reporter} believes {reporter_size}"
    else:
        what = f"rank {culprit}'s hostfile lists other addresses than rank {reporter}'s (both list {reporter_size} ranks)"
    return LayoutMismatch(f"{prefix}the ranks disagree on the group's layout: {what} (reported by rank "
                          f"{reporter}); give every rank the same hostfile", reporter, culprit, culprit_size,
                          reporter_size)


class Watch:
    """The connections a forming ring listens to for a death or an abort.

    find_abort(peeked bytes) -> (reporter, culprit, missing) of an abort header among them, or
    None; abort_frame(culprit, missing) -> the header to send; explain(reporter, culprit,
    missing) -> the message;
    describe(rank) -> how a member is named; forming: what forms ("the group"); prefix: put
    before each message ("rank 3: "; a split adds its own)."""

    def __init__(self, find_abort: Callable[[bytes], "tuple[int, int, bool] | None"],
                 abort_frame: Callable[[int, bool], bytes], explain: Callable[[int, int, bool], str],
                 describe: Callable[[int], str], forming: str,
                 error: type[FormationAbandoned] = FormationAbandoned, prefix: str = "") -> None:
        self._find_abort = find_abort
        self._abort_frame = abort_frame
        self._explain = explain
        self._describe = describe
        self._forming = forming
        self._error = error
        self._prefix = prefix
        self._links: list[tuple[socket.socket, int]] = []
        self._heard: set[socket.socket] = set()  # ended, and their news left to this rank's deadline
        self._listeners: list[tcp.Listener] = []
        self._on_arrival: Callable[[], None] | None = None
        self._waits_for: Callable[[int], bool] | None = None
        self._tick: Callable[[], None] | None = None  # called every _period seconds while waiting
        self._period = 0.0
        self._next_tick = 0.0

    def explain(self, reporter: int, culprit: int, missing: bool = False) -> str:
        """The message for an abort header from `reporter` naming `culprit`."""
        return self._explain(reporter, culprit, missing)

    def add(self, sock: socket.socket, peer: int) -> None:
        """Watch a connection to or from member `peer`."""
        self._links.append((sock, peer))

    def linked(self, peer: int) -> bool:
        return any(p == peer for _, p in self._links)

    def wake_on(self, listeners: list[tcp.Listener], on_arrival: Callable[[], None] | None,
                waits_for: Callable[[int], bool] | None = None) -> None:
        """While waiting, call on_arrival() whenever one of these listeners queued a connection.
        waits_for(rank): whether this rank itself still waits for that member; news that it
        missed the deadline is then left to this rank's own deadline, whose error is more precise
        (where it should have connected), and comes at about the same time."""
        self._listeners, self._on_arrival, self._waits_for = list(listeners), on_arrival, waits_for

    def every(self, seconds: float, tick: Callable[[], None] | None) -> None:
        """While waiting, call tick() every `seconds` (None: stop); it may raise to end the wait."""
        self._tick, self._period, self._next_tick = tick, seconds, time.monotonic() + seconds

    def died(self, peer: int, why: str) -> FormationAbandoned:
        """The error for member `peer` found dead some other way than by a connection ending."""
        return self._error(peer, f"{self._prefix}{self._describe(peer)} died while {self._forming} formed ({why})")

    def check(self) -> None:
        self._look(0.0)

    def wait(self, until: float, done: Callable[[], bool] | None = None) -> None:
        """Sleep until `until` (time.monotonic) or done(); raise as soon as a watched link ends."""
        timeout = 0.0
        while True:
            self._look(timeout)
            if done is not None and done():
                return
            now = time.monotonic()
            if self._tick is not None and now >= self._next_tick:
                self._next_tick = now + self._period
                self._tick()
                now = time.monotonic()
            timeout = until - now
            if timeout <= 0:
                return
            if self._tick is not None:
                timeout = min(timeout, max(0.0, self._next_tick - now))

    def pause(self, seconds: float) -> None:
        """tcp.connect's wait between attempts."""
        self.wait(time.monotonic() + seconds)

    def _look(self, timeout: float) -> None:
        poller = select.poll()
        links = {sock.fileno(): (sock, peer) for sock, peer in self._links
                 if sock.fileno() >= 0 and sock not in self._heard}
        for fd in links:
            poller.register(fd, select.POLLRDHUP)
        arrivals = {}
        for listener in self._listeners:
            arrivals[listener.ready_fd()] = listener
            poller.register(listener.ready_fd(), select.POLLIN)
        events = poller.poll(max(0, int(timeout * 1000 + 0.999)))
        ended = [links[fd] for fd, what in events if fd in links and what & ENDED]
        if ended or any(fd in arrivals for fd, _ in events):
            # Taken also when a link ended: the connection that explains that end (a neighbour's,
            # sent on with its abort as it gave up) may have been queued meanwhile.
            for listener in self._listeners:
                listener.drain_ready()
            if self._on_arrival is not None:
                self._on_arrival()
        if ended:
            # A link taken just now that already ended, with an abort, explains the bare close of
            # another in the same look (the member that closed gave up because of its news).
            fresh = [(sock, peer) for sock, peer in self._links
                     if sock.fileno() >= 0 and sock.fileno() not in links and sock not in self._heard]
            if fresh:
                poller = select.poll()
                for sock, _ in fresh:
                    poller.register(sock.fileno(), select.POLLRDHUP)
                now_ended = {fd for fd, what in poller.poll(0) if what & ENDED}
                ended += [link for link in fresh if link[0].fileno() in now_ended]
        verdicts = []
        for link in ended:
            error, aborted = self._verdict(*link)
            if error.missing and self._waits_for is not None and self._waits_for(error.culprit):
                self._heard.add(link[0])  # its stream is over; this rank's own deadline follows
                continue
            verdicts.append((not aborted, error))
        if verdicts:
            raise min(verdicts, key=lambda v: v[0])[1]  # an abort's explanation before a bare close

    def _verdict(self, sock: socket.socket, peer: int) -> tuple[FormationAbandoned, bool]:
        """The error for a connection that ended, and whether it carried an abort (else: a death)."""
        try:
            data = sock.recv(4096, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            data = b""
        layout = find_layout_abort(data)
        if layout is not None:
            return layout_told(self._prefix, layout), True
        found = self._find_abort(data)
        if found is not None:
            reporter, culprit, missing = found
            return self._error(culprit, self._prefix + self._explain(reporter, culprit, missing), missing), True
        return self._error(peer, f"{self._prefix}{self._describe(peer)} died while {self._forming} formed "
                                 f"(its connection closed)"), False

    def abandon(self, culprit: int, missing: bool = False, frame: bytes | None = None) -> bytes:
        """Tell every watched member that the formation failed and whom to blame (or send
        `frame`, an abort header of another kind), then stop writing to it (the end of the
        stream wakes its poll). Returns the frame sent."""
        frame = frame or self._abort_frame(culprit, missing)
        for sock, _ in self._links:
            try:
                sock.send(frame, socket.MSG_DONTWAIT)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        return frame
