"""Whom to blame when a group fails: written once for every socket backend (the ring's notice
connections, origin.py; JACCL's TCP mesh and its in-band notices, tcp_mesh.py / exchange.py).

The culprit codes a notice carries, whatever carries it:
    q >= 0                       rank q died or failed (the relay: "rank q died or failed
                                 (reported by rank p ...)")
    STUCK (-1)                   the sender gave up on an error of its own, or (after a deadline)
                                 it is stuck too, waiting for another rank
    OUTER - q (<= OUTER)         rank q of the whole group, where a leaders' ring links hosts
    MISMATCH + a * SPAN + b      ranks a and b called different collectives

The rules:
- A deadline: the ranks this one waited for were asked whether they are stuck too. The first
  that did not say so within STUCK_WAIT_S is the culprit (a stopped process cannot speak, a rank
  outside the operation does not); when all are stuck, the name one of them relays within
  RELAY_WAIT_S is adopted (silent_rank).
- A formation's deadline (init's closing barrier, a split): ranks start up to a second apart, so
  a live member may not have reached its own deadline and cannot say it is stuck yet. There the
  evidence is the member's listener: a live process's acceptor thread answers a probe whatever
  its main thread waits for; a stopped one's kernel accepts and nobody answers; a dead one, or
  one never started, refuses. The first member, in the order the caller waits on them, that
  does not answer within PROBE_S is the culprit (first_unresponsive).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable, Sequence

from ...errors import NOTICE, PeerError, with_failure
from . import tcp
from .handshake import ALIVE, CHALLENGE, CHALLENGE_MAGIC, PURPOSE_PROBE, Hello, peer_uid

log = logging.getLogger("jacklring.tcp")
_squats_seen: set[str] = set()

STUCK = -1
OUTER = -2
MISMATCH, MISMATCH_SPAN = 1 << 30, 1 << 14
STUCK_WAIT_S = 0.15  # after a deadline: how long the ranks waited for have to say they are stuck too
RELAY_WAIT_S = 0.35  # ... and, when all are, how long to wait for one of them to name the silent rank
PROBE_S = 0.3        # how long a live member's acceptor may take to answer a liveness probe, at most
PROBE_MIN_S = 0.1    # ... at least, once another member answered
ANSWER_FACTOR = 4    # ... and, in between, this many times the slowest answer seen
PROBE_MAX = 32       # members probed at once (the nearest, in the caller's order)


def mismatch_code(a: int, b: int) -> int:
    return MISMATCH + min(a, b) * MISMATCH_SPAN + max(a, b)


def mismatch_pair(code: int) -> tuple[int, int] | None:
    """The two ranks of a mismatch code, or None for any other code."""
    return divmod(code - MISMATCH, MISMATCH_SPAN) if code >= MISMATCH else None  # type: ignore[return-value]


def relay_text(culprit: int, reporter: str) -> str:
    """A peer gave up because of `culprit` and said so before it closed its connection."""
    return f"rank {culprit} died or failed (reported by {reporter}, which closed its connection to this rank after that)"


def relay_error(prefix: str, culprit: int, reporter: int, reporter_label: str | None = None) -> PeerError:
    """The PeerError of a relayed verdict: culprit `culprit`, peer `reporter`."""
    error = PeerError(prefix + relay_text(culprit, reporter_label or f"rank {reporter}"))
    return with_failure(error, culprit=culprit, peer=reporter, how=NOTICE)  # type: ignore[return-value]


def silent_rank(waited: Sequence[int], stuck: set[int]) -> int | None:
    """The first rank waited for that did not say it is stuck too (None: all did)."""
    return next((q for q in waited if q not in stuck), None)


def silence_text(culprit: int, waited_s: float) -> str:
    return (f"rank {culprit} is the rank that went silent: it neither sent nor said within {waited_s:g} s "
            f"that it waits for another rank (it is stopped, or not in this operation)")


def unresponsive_text(described: str) -> str:
    return f"{described} went silent: its listener did not answer a liveness probe (it is stopped, or gone)"


ALIVE_, SILENT, GONE = "alive", "silent", "gone"


def _report_squat(name: str, uid: int | None) -> None:
    if name not in _squats_seen:
        _squats_seen.add(name)
        log.warning("jacklring: the local name %r of a rank's address is held by uid %s, not this user: a "
                    "liveness probe ignores its answer and asks the rank's TCP address", name.lstrip("\0"), uid)


def answers(address: str, token: int, sender: int, receiver: int, until: float) -> str:
    """How the listener of rank `receiver` of the group `token` at address answers a liveness
    probe before `until` (time.monotonic): ALIVE_; SILENT (it accepts, nobody answers: stopped,
    or too busy); GONE (refused or closed unanswered: dead, never started, leaving after it gave
    up, or another incarnation's listener)."""
    host, port = tcp.parse_address(address)
    name = tcp.local_name(host, port)
    targets = ([(socket.AF_UNIX, name)] if name else []) + [(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                                             (host, port))]
    hello = Hello(PURPOSE_PROBE, sender, receiver, 0, token).fresh().pack()
    for family, target in targets:
        remaining = until - time.monotonic()
        if remaining <= 0:
            return SILENT
        answer = b""
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(remaining)
                sock.connect(target)
                if family == socket.AF_UNIX and peer_uid(sock) != os.getuid():
                    # Not this user's process: a squatter on the name could answer anything,
                    # so the rank is judged at its TCP address alone (as every other Unix
                    # connection checks its peer's uid).
                    _report_squat(str(target), peer_uid(sock))
                    continue
                sock.sendall(hello)
                while len(answer) < CHALLENGE.size:
                    chunk = sock.recv(CHALLENGE.size - len(answer))
                    if not chunk:
                        break
                    answer += chunk
        except (ConnectionRefusedError, FileNotFoundError):
            continue  # no Unix socket (another host, or gone): try TCP; refused there too: gone
        except (ConnectionResetError, BrokenPipeError):
            return GONE  # its listener closed with this connection queued: the process is leaving
        except OSError:
            return SILENT  # no answer in time: stopped (or unreachable)
        if len(answer) == CHALLENGE.size:
            magic, status, _ = CHALLENGE.unpack(answer)
            if magic == CHALLENGE_MAGIC and status == ALIVE:
                return ALIVE_
        return GONE  # closed without the answer: leaving, or not this group's listener any more
    return GONE


class Probe:
    """Liveness probes of the members in `order` (the first PROBE_MAX), side by side, started at
    once; decided() says, without blocking, whether they are decided and whom they blame.

    A live member answers in milliseconds (its acceptor thread, whatever its main thread does);
    on a loaded host in tens. So once all but one have answered, the last gets ANSWER_FACTOR
    times the slowest answer seen (at least PROBE_MIN_S), not the whole budget: that is what an
    error waits for when a member is stopped. While two or more are silent, at least one is
    only slow (with a single fault): they get the whole budget."""

    def __init__(self, order: Sequence[int], address_of: Callable[[int], str], token: int, sender: int,
                 budget: float = PROBE_S) -> None:
        self.order = list(order)[:PROBE_MAX]
        self._start = time.monotonic()
        self._until = self._start + budget
        self._verdicts: dict[int, tuple[str, float]] = {}
        self._changed = threading.Condition()
        for q in self.order:
            threading.Thread(target=self._probe, args=(q, address_of(q), token, sender), daemon=True,
                             name=f"liveness-probe-{q}").start()

    def _probe(self, q: int, address: str, token: int, sender: int) -> None:
        verdict = answers(address, token, sender, q, self._until)
        with self._changed:
            self._verdicts[q] = (verdict, time.monotonic() - self._start)
            self._changed.notify_all()

    def _closes_at(self) -> float:
        answered = [took for verdict, took in self._verdicts.values() if verdict != SILENT]
        if not answered or len(self.order) - len(self._verdicts) > 1:
            return self._until  # two still silent: one is only slow (a single fault), wait for it
        return min(self._until, self._start + max(PROBE_MIN_S, ANSWER_FACTOR * max(answered)))

    def decided(self, accept_gone: bool = True) -> tuple[bool, int | None]:
        """(whether the probes are decided, the culprit): the first member that accepts but does
        not answer (stopped: it cannot have said anything), else (accept_gone) the first that
        refuses (dead or never started; one that gave up and left has usually passed its
        verdict on by then, which the caller looks at first); None when all answer."""
        with self._changed:
            done = len(self._verdicts) == len(self.order) or time.monotonic() >= self._closes_at()
            found = {q: self._verdicts.get(q, (SILENT, 0.0))[0] for q in self.order}
        if not done:
            return False, None
        silent = next((q for q in self.order if found[q] == SILENT), None)
        if silent is None and accept_gone:
            silent = next((q for q in self.order if found[q] == GONE), None)
        return True, silent

    def wait(self, accept_gone: bool = True) -> int | None:
        """Block until decided; the culprit (see decided)."""
        while True:
            done, culprit = self.decided(accept_gone)
            if done:
                return culprit
            with self._changed:
                self._changed.wait(max(0.001, self._closes_at() - time.monotonic()))


def first_unresponsive(order: Sequence[int], address_of: Callable[[int], str], token: int, sender: int,
                       budget: float = PROBE_S) -> int | None:
    """Probe the members in `order` and wait for the verdict (Probe.decided)."""
    return Probe(order, address_of, token, sender, budget).wait()
