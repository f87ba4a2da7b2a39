"""The native shared-memory engine (csrc/shm, bound as `_engine`): whether it is here, and the
one place where its statuses become today's exceptions.

The engine returns None for success, else a status tuple (code, member, culprit, fd, errno,
step, peer_step, peer's header); `raise_status` words it for the segment that ran the call.
Installed with JACKLRING_NO_NATIVE=1 (or where it cannot load), `why_missing()` says why and
same-host groups use their sockets (local/shm.py logs that once per process).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, NoReturn

from ... import config
from ...errors import DEADLINE, SHARED, CollectiveTimeout, MismatchError, PeerError, with_failure

if TYPE_CHECKING:
    from .segment import SharedGroup

log = logging.getLogger("jacklring.shm")

try:
    from . import _engine
    _WHY: str | None = None
except ImportError as exc:  # installed without it (JACKLRING_NO_NATIVE=1) or a broken build
    _engine = None  # type: ignore[assignment]
    _WHY = f"the native shared-memory engine is not installed ({exc})"

# Status codes (csrc/shm/engine.h jl_code).
OK, MISMATCH, PEER_LEFT, PEER_EXITED, LINK_CLOSED, TIMEOUT, SELF_BROKEN, INVALID, SYSTEM, INTERRUPTED = range(10)

_warned = False


def why_missing() -> str | None:
    """None when the engine is usable, else why not."""
    if _WHY is None and config.get("JACKLRING_NO_NATIVE"):
        return "JACKLRING_NO_NATIVE=1"
    return _WHY


def warn_missing_once(rank: int) -> None:
    """One warning line per process: same-host ranks talk over sockets (slower), not an error."""
    global _warned
    if not _warned:
        _warned = True
        log.warning("rank %d: %s; ranks on one host use sockets", rank, why_missing())


def segment_type():
    """The engine's Segment type (only when why_missing() is None)."""
    return _engine.Segment


def new_lock() -> object:
    """The lock a group takes to run one collective at a time: the engine's (which its fast path,
    Shell, takes in C: one lock for every path), or threading's without the engine."""
    return threading.Lock() if why_missing() else _engine.Lock()


def is_engine_lock(lock: object) -> bool:
    return _engine is not None and type(lock) is _engine.Lock


def shell_type():
    """The engine's Shell type, the fast path (only when why_missing() is None)."""
    return _engine.Shell


def raise_status(group: "SharedGroup", status: tuple, header: bytes | None) -> NoReturn:
    """Raise the exception today's engine raised for this status, worded as it was."""
    code, member, culprit, fd, err, step, peer_step, theirs = status
    me = group.names[group.rank]
    what = group.what
    if code == MISMATCH:
        raise MismatchError(group.mismatch_text(header or b"", bytes(theirs), member))
    if code == PEER_LEFT:
        name = group.names[member]
        if culprit < 0:
            # the peer gave up waiting for this (stopped, resumed) rank: naming it would get a live
            # rank excluded by a shrink, so nobody is named
            text = (f"rank {name} (pid {group.pids[member]}) gave up waiting for this rank: this process was stopped or "
                    f"too slow, and the others may have carried on without it (shared memory)")
        elif culprit != name:
            text = (f"rank {culprit} died or failed (reported by rank {name} (pid {group.pids[member]}), which left "
                    f"the group after that) (shared memory)")
        else:
            text = f"rank {name} (pid {group.pids[member]}) left the group after an error (shared memory)"
        raise _peer_error(me, what, text, culprit)
    if code == PEER_EXITED:
        name = group.names[member]
        raise _peer_error(me, what, f"rank {name} (pid {group.pids[member]}) exited while this rank waited for it "
                                    f"(shared memory)", name)
    if code == LINK_CLOSED:
        label = group.watched_label(fd)
        raise _peer_error(me, what, f"{label} closed its connection (the peer died or raised)", culprit)
    if code == TIMEOUT:
        late = CollectiveTimeout(
            f"rank {me}: {what} timed out: rank {group.names[member]} (pid {group.pids[member]}) is alive "
            f"but has not reached step {step} (it is at {peer_step}) of this collective (shared memory)")
        # The rank waited for is to blame, not this one: passed on by mark_broken, so the peers
        # this rank's exit fails name the stalled rank too, never this live one.
        raise with_failure(late, culprit=culprit, how=DEADLINE)
    if code == SELF_BROKEN:
        raise PeerError(f"rank {me}: {what}: this rank gave the group up while this collective waited (shared memory)")
    if code == SYSTEM:
        raise OSError(err, f"rank {me}: {what}: shared memory: {os.strerror(err)}")
    raise TypeError(f"rank {me}: {what}: the shared-memory engine refused the arguments (status {code})")


def _peer_error(me: int, what: object, text: str, culprit: int) -> PeerError:
    # The backend passes the culprit on (mark_broken) so every survivor names the same rank.
    return with_failure(PeerError(f"rank {me}: {what}: {text}"), culprit=culprit, how=SHARED)  # type: ignore[return-value]
