"""JacklringWork: the Work (and its futures) that every operation of the jacklring process
group returns; the contract is docs/torch.md's "Work and Future contract". The threads that
run operations and complete Works are executors.py's.
"""
from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeout
from .torch_errors import torch_flavoured


class JacklringWork(dist.Work):
    """The handle torch gets back from every operation of the jacklring process group.

    Two futures, made when someone first asks for one (get_future, from Python or C++): `_raw`
    is completed (always with None) by the completer; the future handed out is
    `_raw.then(self._outcome)`, which returns the output tensors or raises the error. An
    exception raised in a `then` callback is stored by C++ with Future::setError, so Python and
    C++ callers both see a failed future. Once the future exists every query reads its state, so
    they agree with it at every moment; before, nobody can hold it, and they read `_done`. A
    Work whose op ends before anyone asked for its future (every inline op) never pays for
    futures nobody uses. `_latch` is a lock held until completion: wait() acquires it.

    A Work born finished (`finished=True`: an inline op, made once it has run) has no latch and
    shares one future lock with every other such Work: its only critical section is the first
    get_future(), which runs no user code. The attributes few Works change are class defaults,
    so a synchronous op pays for a handful of instance writes only."""

    _error: BaseException | None = None
    _peer = -1
    _completing_thread: int | None = None
    _raw: torch.futures.Future | None = None
    _future: torch.futures.Future | None = None
    _future_lock = threading.Lock()  # a born-finished Work's (see above); pending ones have their own

    def __init__(self, what: str, result: list[torch.Tensor], source_rank: int = -1,
                 finished: bool = False, error: BaseException | None = None) -> None:
        super().__init__()
        self._what = what
        self._result = result
        if source_rank != -1:
            self._peer = source_rank
        if finished:
            if error is not None:
                self._error = error
            self._done = True
            return
        self._done = False  # completed, and the callbacks added before have run
        self._latch = threading.Lock()
        self._latch.acquire()  # released on completion
        self._future_lock = threading.Lock()

    # ---- called by the executors ----------------------------------------------------------

    def _finish(self, error: BaseException | None) -> None:
        """Communication is over; the future is completed later, by the completer."""
        self._error = error

    def _complete_unobserved(self) -> bool:
        """Complete the Work now when nobody holds its future (it has no callbacks, so the
        finishing thread may do it at no risk); False when the completer must run them."""
        with self._future_lock:
            if self._raw is not None:
                return False
            self._mark_done()
        return True

    def _mark_done(self) -> None:
        self._done = True
        self._latch.release()

    def _complete_future(self) -> None:
        """Complete the future and run the callbacks added so far (as gloo's AsyncWork does
        before it finishes its Work); only then may wait() return. A thread still inside C++
        completion code when the interpreter shuts down is aborted (std::terminate), so wait()
        must not let the main thread run ahead of it."""
        if self._complete_unobserved():
            return
        self._completing_thread = threading.get_ident()
        try:
            self._raw.set_result(None)
        finally:
            self._mark_done()

    def _outcome(self, _raw: Any) -> list[torch.Tensor]:
        if self._error is not None:
            raise self._error
        return self._result

    # ---- torch's Work interface -----------------------------------------------------------

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        if not self._done:
            seconds = _seconds(timeout)
            future = self._future
            if self._completing_thread == threading.get_ident() and future is not None and future.done():
                pass  # called from one of this future's own callbacks: it is completed
            elif not self._latch.acquire(timeout=-1 if seconds is None else seconds):
                raise torch_flavoured(CollectiveTimeout)(
                    f"Timed out waiting {seconds * 1000:.0f}ms for {self._what} to complete (the timeout given to Work.wait)")
            else:
                self._latch.release()  # let every other waiter through
        if self._error is not None:
            raise self._error
        return True

    def _is_done(self) -> bool:
        future = self._future
        return future.done() if future is not None else self._done

    def is_completed(self) -> bool:
        return self._is_done()

    def is_success(self) -> bool:
        return self._is_done() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error if self._is_done() else None

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        with self._future_lock:
            if self._future is None:
                raw = torch.futures.Future()
                future = raw.then(self._outcome)
                if self._done:  # completed before anyone asked: the future is born completed
                    raw.set_result(None)
                self._raw, self._future = raw, future
            return self._future

    def source_rank(self) -> int:
        return self._peer

    def _source_rank(self) -> int:  # what torch.distributed.recv(src=None) asks
        return self._peer

    def _set_source_rank(self, peer: int) -> None:
        """A recv from any source learns its peer when a message is matched."""
        self._peer = peer

    def synchronize(self) -> None:
        """CPU work has no stream to synchronise with."""

    def __repr__(self) -> str:
        state = "pending" if not self._is_done() else ("ok" if self._error is None else "failed")
        return f"<JacklringWork {self._what} {state}>"


def _seconds(timeout: datetime.timedelta | float | None) -> float | None:
    """torch passes timedelta(0) (kNoTimeout) for "wait forever"."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return seconds if seconds > 0 else None
