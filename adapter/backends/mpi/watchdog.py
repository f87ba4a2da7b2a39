"""Deadlines for blocking MPI calls: a watchdog thread that aborts the job when one overruns.

A blocked MPI call cannot be interrupted or cancelled, so the deadline cannot surface as an
exception on the calling thread. Instead one daemon thread per process looks at the calls in
flight a few times per second; when one passes its deadline it prints a CollectiveTimeout
message naming the rank, the call and the deadline to stderr and calls MPI_Abort, which
makes mpirun stop every rank of the job with a non-zero exit code. The job ends, it never hangs.

Registering a call costs two dict operations, so blocking calls keep their full speed (the
nonblocking alternative, Iallreduce polled with Test, is slower: docs/architecture.md, MPI).
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Callable

# Exit code passed to MPI_Abort, the one `timeout(1)` uses, so scripts can tell a deadline from a crash.
ABORT_CODE = 124
_POLL_S = 0.1


def describe(what: tuple) -> str:
    """The text of a (format string, *arguments) call description."""
    return what[0].format(*what[1:])


class Watchdog:
    """Tracks in-flight calls and aborts the job through `abort` when one passes its deadline."""

    def __init__(self, abort: Callable[[int], None]) -> None:
        self._abort = abort
        self._ids = itertools.count()
        # token -> (deadline, timeout, who, what); written by callers, read by the thread.
        self._active: dict[int, tuple[float, float, str, tuple]] = {}
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def start(self, timeout: float, who: str, what: tuple) -> int:
        """Register a call that must finish within timeout seconds; returns the token for stop().

        what: (format string, *arguments), formatted by describe() only if the deadline passes.
        """
        if self._thread is None:
            self._start_thread()
        token = next(self._ids)
        self._active[token] = (time.monotonic() + timeout, timeout, who, what)
        return token

    def stop(self, token: int) -> None:
        self._active.pop(token, None)

    def _start_thread(self) -> None:
        with self._start_lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="jacklring-mpi-watchdog", daemon=True)
                thread.start()
                self._thread = thread

    def _run(self) -> None:
        while True:
            time.sleep(_POLL_S)
            now = time.monotonic()
            for deadline, timeout, who, what in list(self._active.values()):
                if now > deadline:
                    self._expire(timeout, who, what)
                    return

    def _expire(self, timeout: float, who: str, what: tuple) -> None:
        message = (
            f"jacklring: CollectiveTimeout: {who}: {describe(what)} did not finish within {timeout:g} s "
            "(deadlines: init(timeout=...) or JACKLRING_TIMEOUT per operation, JACKLRING_CONNECT_TIMEOUT "
            "for forming the group). A blocked MPI call "
            f"cannot be cancelled, so the whole MPI job is aborted (MPI_Abort errorcode {ABORT_CODE}).\n"
        )
        # os.write, not print: the main thread may hold sys.stderr's lock while it is blocked.
        try:
            os.write(2, message.encode())
        except OSError:
            pass
        self._abort(ABORT_CODE)
