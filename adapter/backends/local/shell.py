"""One collective at a time, numbered, with header, deadline and failure: the shell every
collective of a group runs in, written once for the ring (ring/plumbing.py: the socket paths and
shared memory), JACCL's same-host path (jaccl/local.py) and the staged stages of either
(staged.py).

A collective takes the group's lock (or, for a group that takes one operation at a time, is
refused when another thread holds it), fails at once when the group failed before, counts itself
in the group's sequence number (the count of collectives, in every header), and runs under a
deadline with a description of its header for error messages; on an error the backend's
handler gives the group up and names the rank at fault.

The sequence number lives in the engine while the whole group shares a segment (attach): one
count for these paths, the engine's fast path and C++ callers. The fast path (fast_path(): the
engine's Shell, csrc/python/shell.c) is this shell in C for one all_reduce of numpy arrays: it
takes this lock, refuses when the group failed, counts in the same sequence and hands a failure
to fast_failed, which words and handles it as on_segment does.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from ..base import GroupFailure
from . import use

if TYPE_CHECKING:
    from .segment import SharedGroup
    from .staged import Staging

# The header layouts the engine's fast path packs (csrc/python/shell.c SHELL_RING, SHELL_JACCL):
# the ring's (ring/header.py) and JACCL's (jaccl/frame_header.py).
RING_HEADER, JACCL_HEADER = 0, 1


class Described:
    """Formats a header only when an error message needs it (off the hot path)."""

    __slots__ = ("header", "describe")

    def __init__(self, header: bytes, describe: Callable[[bytes], str]) -> None:
        self.header = header
        self.describe = describe

    def __str__(self) -> str:
        return self.describe(self.header)


class CollectiveShell:
    """One group's collectives, one at a time. failed(caught) gives the group up after a
    collective raised `caught`: it raises what names the rank at fault, or returns and `caught`
    propagates. refuse(name), when given, makes a busy group refuse a second thread's collective
    `name` with the error it returns, instead of waiting."""

    def __init__(self, failure: GroupFailure, describe: Callable[[bytes], str],
                 failed: Callable[[BaseException], None], lock: object | None = None,
                 refuse: Callable[[str], BaseException] | None = None) -> None:
        self.lock = use.new_lock() if lock is None else lock
        self.failure = failure
        self.deadline = 0.0          # the running collective's (time.monotonic)
        self.what: object = None     # the running collective, described on demand
        self._describe = describe
        self._failed = failed
        self._refuse = refuse
        self._counter: object = _Count()  # what keeps the count: its `sequence`
        self._segment: SharedGroup | None = None

    # ---- the sequence number ----------------------------------------------------------------

    @property
    def seq(self) -> int:
        """Collectives run so far (in every header): the segment's count while one is attached."""
        return self._counter.sequence  # type: ignore[attr-defined]

    @seq.setter
    def seq(self, value: int) -> None:
        self._counter.sequence = value  # type: ignore[attr-defined]

    @property
    def segment(self) -> "SharedGroup | None":
        """The whole group's segment, which keeps the count, or None."""
        return self._segment

    def attach(self, segment: "SharedGroup | None") -> None:
        """Count in `segment` from now on (None: here again); the count moves with it."""
        count = self._counter.sequence  # type: ignore[attr-defined]
        self._counter = _Count() if segment is None else segment.counter
        self._counter.sequence = count  # type: ignore[attr-defined]
        self._segment = segment

    # ---- one collective ---------------------------------------------------------------------

    def enter(self, header: bytes, timeout: float, name: str = "") -> None:
        """Start a collective: the lock taken, the group's failure checked, the sequence advanced,
        the deadline and description set."""
        lock = self.lock
        if self._refuse is None:
            lock.acquire()  # type: ignore[attr-defined]
        elif not lock.acquire(False):  # type: ignore[attr-defined]
            raise self._refuse(name)
        try:
            failure = self.failure
            if failure.why is not None:
                failure.check()
            self._counter.sequence += 1  # type: ignore[attr-defined]
            self.deadline = time.monotonic() + timeout
            self.what = Described(header, self._describe)
        except BaseException:
            lock.release()  # type: ignore[attr-defined]
            raise

    def leave(self, caught: BaseException | None) -> None:
        """End the collective; on an error, give the group up (failed) first."""
        try:
            if caught is not None:
                self._failed(caught)
        finally:
            self.lock.release()  # type: ignore[attr-defined]

    def running(self, header: bytes, timeout: float) -> "_Running":
        """`with shell.running(header, timeout):` runs one collective (enter ... leave)."""
        return _Running(self, header, timeout)

    def on_segment(self, header: bytes, timeout: float, group: "SharedGroup", body: Callable, *args,
                   name: str = "") -> None:
        """body(group, header, *args) over a segment as one collective, in one frame (the frames
        cost more than a 4-byte all_reduce over shared memory itself): on an error the peers are
        told at once (use.broken), then the group is given up."""
        self.enter(header, timeout, name)
        try:
            group.deadline = self.deadline
            group.what = self.what
            try:
                body(group, header, *args)
            except BaseException as exc:
                use.broken(group, exc)
                raise
        except BaseException as caught:
            self._failed(caught)  # raises what names the culprit, or returns for caught itself
            raise
        finally:
            self.lock.release()  # type: ignore[attr-defined]

    def on_stages(self, header: bytes, timeout: float, staging: "Staging", body: Callable, *args,
                  name: str = "") -> None:
        """body(staging, header, *args) in stages (staged.py) as one collective: the host's
        stages under the deadline, the leaders' under `timeout`; on an error the host's ranks and
        the other leaders are told at once (staging.fail), then the group is given up."""
        self.enter(header, timeout, name)
        try:
            staging.start(self.deadline, timeout, self.what)
            try:
                body(staging, header, *args)
            except BaseException as exc:
                staging.fail(exc)
                raise
        except BaseException as caught:
            self._failed(caught)
            raise
        finally:
            self.lock.release()  # type: ignore[attr-defined]

    # ---- the engine's fast path ----------------------------------------------------------

    def fast_path(self, timeout: float, magic: int, op_codes: list[int], extras: list[int],
                  layout: int = RING_HEADER, stage: int = 0) -> object | None:
        """The engine's one-call collectives in this shell over the attached segment (None
        without one, or when the lock is not the engine's); see SharedGroup.fast_path for the
        header's fields. A shell that refuses a busy group's second thread makes the fast path
        leave such a call to the Python path, which refuses it."""
        segment = self._segment
        if segment is None or not use.is_engine_lock(self.lock):
            return None
        return segment.fast_path(self.lock, self.failure, self.fast_failed, timeout, magic, op_codes, extras,
                                 layout, self._refuse is not None, stage)

    def fast_failed(self, header: bytes, deadline: float, status: object) -> None:
        """The fast path failed a collective it numbered and started at `deadline` over the
        segment: status is the engine's status tuple, or the exception a signal handler raised.
        Called with the lock held; raises what on_segment raises for it."""
        group = self._segment
        assert group is not None
        self.deadline = group.deadline = deadline
        self.what = group.what = Described(header, self._describe)
        try:
            try:
                if isinstance(status, BaseException):
                    raise status
                group.raise_status(status, header)  # type: ignore[arg-type]
            except BaseException as exc:
                use.broken(group, exc)
                raise
        except BaseException as caught:
            self._failed(caught)
            raise


class _Count:
    """The count while no segment keeps it."""

    __slots__ = ("sequence",)

    def __init__(self) -> None:
        self.sequence = 0


class _Running:
    """One collective in progress (CollectiveShell.running)."""

    __slots__ = ("shell", "header", "timeout")

    def __init__(self, shell: CollectiveShell, header: bytes, timeout: float) -> None:
        self.shell = shell
        self.header = header
        self.timeout = timeout

    def __enter__(self) -> None:
        self.shell.enter(self.header, self.timeout)

    def __exit__(self, kind: type | None, caught: BaseException | None, trace: object) -> bool:
        self.shell.leave(caught)
        return False
