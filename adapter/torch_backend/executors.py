"""Execution for the torch "jacklring" process group.

- A collective the caller waits for at once (torch's `async_op=False`, `opts.asyncOp` False)
  runs on the calling thread when nothing of its group is queued or running, and its Work is
  complete when it is returned: no thread hand-off on the synchronous path.
- Every other collective (`async_op=True`, and every call from torch's C++, such as DDP's
  bucket all-reduces from the autograd hooks) runs in issue order on one communication thread
  per process group, so the caller returns at once and backward overlaps communication. An op
  submitted while others are queued or running joins the queue behind them (issue order holds).
- Point-to-point sends run on one worker thread per peer (messages to a peer stay in order);
  receives from a peer are matched by tag on an Inbox thread of their own, so an irecv posted
  before the matching isend cannot block the send, and recvs may be posted in any tag order.
- A future that someone holds (`get_future()` was called) is completed on a separate
  completion thread, never on a communication thread: a `.then` callback that issues (and even
  waits for) a new collective, as PowerSGD does, runs while the communication thread is free to
  execute it. A future nobody holds yet has no callbacks, so the finishing thread completes it
  itself (`JacklringWork._complete_unobserved`), and a later `get_future()` makes it completed.
- The Work keeps c10d's contract (docs/torch.md, "Work and Future contract"): wait() returns
  only once the future is completed and the callbacks added before have run; the future carries errors the way C++ Future::setError
  does, so DDP's reducer and other C++ callers see a failed future, never a "successful" one
  holding an exception object.
"""
from __future__ import annotations

import atexit
import collections
import gc
import sys
import threading
import time
import weakref
from typing import Any, Callable

import torch

from .work import JacklringWork

_COMPLETERS: weakref.WeakSet = weakref.WeakSet()

# Executor._finished_work's reuse relies on sys.getrefcount counting every reference, as
# CPython with a GIL does up to 3.13 (3.14 may skip counting references from the stack, and a
# free-threaded build defers some).
_REUSE_WORKS = (sys.implementation.name == "cpython" and sys.version_info < (3, 14)
                and getattr(sys, "_is_gil_enabled", lambda: True)())
_SPARE_MAX_BYTES = 1 << 20  # the most tensor memory a kept Work may keep alive between ops


@atexit.register
def _collect_garbage_at_exit() -> None:
    """Free cyclic garbage (modules, tensors, Works, futures of finished training) while the
    interpreter is whole. Left to the collection inside interpreter finalization, their C++
    teardown runs after other threads have been told to exit, with the GIL released and taken
    again per tensor. CI twice saw a rank abort there ("terminate called without an active
    exception") with a gloo group still alive; the cause is not pinned down (docs/torch.md),
    but this keeps that teardown out of finalization. Registered first, so it runs after the
    drain below."""
    gc.collect()


@atexit.register
def _drain_completions_at_exit() -> None:
    """Completions still running when the interpreter shuts down would be aborted inside
    torch's C++ future code (std::terminate, SIGABRT): let them finish first."""
    deadline = time.monotonic() + 2.0
    for completer in list(_COMPLETERS):
        completer.drain(max(0.0, deadline - time.monotonic()))


class Completer:
    """Completes futures (runs user callbacks) off the communication threads.

    Completions run in finishing order on one thread while callbacks return promptly. A
    callback that blocks (PowerSGD's waits on the future of a collective it just issued)
    would starve every later completion, including the one it waits for; so whenever more
    completions are queued than workers are idle another worker is started (at most
    MAX_WORKERS) to keep completions flowing."""

    MAX_WORKERS = 32

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._pending: collections.deque = collections.deque()
        self._idle = 0
        self._workers: list[threading.Thread] = []
        self._live = 0  # workers that have not returned (counted under the lock)
        self._busy = 0  # completions running now
        self._stopped = False
        _COMPLETERS.add(self)

    def put(self, work: JacklringWork) -> None:
        if work._complete_unobserved():  # nobody holds its future: no callbacks to run
            return
        with self._cond:
            inline = self._stopped and self._live == 0
            if not inline:
                self._pending.append(work)
            # An idle worker that was notified but has not woken yet still counts as idle:
            # compare with the queue length, not with zero, or two quick puts share one worker.
            if len(self._pending) > self._idle and len(self._workers) < self.MAX_WORKERS and not self._stopped:
                worker = threading.Thread(target=self._loop, name=f"{self._name}-complete{len(self._workers)}",
                                          daemon=True)
                self._workers.append(worker)
                self._live += 1
                worker.start()
            elif not inline:
                self._cond.notify()
        if inline:  # after shutdown: a late completion must still complete its future
            self._complete(work)

    @staticmethod
    def _complete(work: JacklringWork) -> None:
        try:
            work._complete_future()
        except BaseException:  # a failing user callback must not stop later completions
            pass

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopped:
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                if not self._pending:
                    self._live -= 1
                    return
                work = self._pending.popleft()
                self._busy += 1
            try:
                self._complete(work)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def drain(self, timeout: float) -> None:
        """Wait until no completion is queued or running (bounded by timeout)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._pending or self._busy) and (self._live or self._busy):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._cond.wait(remaining)

    def stop(self, timeout: float) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            workers = list(self._workers)
        for worker in workers:
            if worker is not threading.current_thread():
                worker.join(timeout)


class Executor:
    """A FIFO of operations run in order on one daemon thread (started on first use); each
    finishes its Work and hands it to the completer. An op run inline (run_inline, or submit
    with inline=True) while nothing is queued or running runs on the calling thread instead and
    is complete when it returns. describe_error turns an exception into one that names rank and
    operation.

    `_busy` is held while an op runs, inline or on the thread. The thread takes it before it
    takes the next op off the queue, and an inline op takes it (without waiting) before it
    checks that the queue is empty: so an inline op never overtakes one queued before it."""

    def __init__(self, name: str, completer: Completer,
                 describe_error: Callable[[str, BaseException], BaseException]) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._busy = threading.Lock()
        self._stopped = False
        self._completer = completer
        self._describe_error = describe_error
        self._thread: threading.Thread | None = None

    def run_inline(self, what: str, result: list[torch.Tensor], run: Callable[..., Any], *args: Any) -> JacklringWork | None:
        """Run the op, run(*args), now on this thread and return its finished Work; None
        (nothing run) when an op of this executor is queued or running, so the caller must
        submit it."""
        if self._queue or not self._busy.acquire(False):
            return None
        try:
            if self._queue:  # queued by another thread before this one took _busy: it goes first
                return None
            # Taken before the op runs, though returned only after: the time after a wait for
            # peers is the expensive part of a call (the wait handed the core to others, the
            # caches are cold), so the little left to do there should be little.
            work = self._finished_work(what, result)
            try:
                run(*args)
            except BaseException as exc:  # surfaces in wait() / the future, never lost
                self._spare = None
                work._error = self._describe_error(what, exc)
        finally:
            self._busy.release()
        return work

    _spare: JacklringWork | None = None

    def _finished_work(self, what: str, result: list[torch.Tensor]) -> JacklringWork:
        """A finished Work for an inline op (called holding _busy). Making one costs more than
        a small op's other checks together, and dist.all_reduce and its kind drop the Work as
        soon as they have waited: so the last one made is kept, and handed out again when
        nothing but this executor refers to it. Then nobody can tell the difference: no
        variable, list, future or callback (a future's callbacks hold the Work), no C++ holder
        (pybind keeps the Python object referenced while C++ holds it) sees it any more. One
        that failed, or whose future was asked for, is never handed out again; nor one over more
        than _SPARE_MAX_BYTES of tensors."""
        spare = self._spare
        # Kept, the Work keeps its tensors alive until the next inline op: only small ones (the
        # ops whose latency this is about), so freeing a big tensor frees its memory.
        held = (result[0].numel() * result[0].element_size() if len(result) == 1
                else sum(t.numel() * t.element_size() for t in result))
        small = _REUSE_WORKS and held <= _SPARE_MAX_BYTES
        # The references counted: self._spare, `spare`, and getrefcount's argument.
        if spare is not None and small and spare._future is None and sys.getrefcount(spare) == 3:
            spare._what = what
            spare._result = result
            return spare
        work = JacklringWork(what, result, finished=True)
        self._spare = work if small else None
        return work

    def submit(self, work: JacklringWork, run: Callable[[], Any], inline: bool = False) -> JacklringWork:
        if inline and not self._queue and self._busy.acquire(False):
            try:
                inline = not self._queue
                if inline:
                    self._execute(work, run)
            finally:
                self._busy.release()
            if inline:
                # Nobody else has seen this Work, so its future has no callbacks yet: complete it here.
                work._complete_future()
                return work
        with self._cond:
            self._queue.append((work, run))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return work

    def _execute(self, work: JacklringWork, run: Callable[[], Any]) -> None:
        try:
            run()
            error = None
        except BaseException as exc:  # surfaces in wait() / the future, never lost
            error = self._describe_error(work._what, exc)
        work._finish(error)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if not self._queue:
                    return  # stopped, and everything submitted before stop() has run
            with self._busy:  # waits for an inline op to end; only this thread pops
                with self._cond:
                    work, run = self._queue.popleft()
                try:
                    self._execute(work, run)
                    run = None  # free staging buffers before the Work can complete (see Inbox._finish)
                    self._completer.put(work)
                finally:
                    work = None

    def wait_idle(self, timeout: float) -> None:
        """Return once nothing is queued or running (an op another thread submits meanwhile may
        start later); TimeoutError after timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if not self._busy.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
                raise TimeoutError(f"{self._name}: operations still running after {timeout:g} s")
            try:
                # Looked at while holding _busy: the thread pops only while it holds it, so an
                # empty queue now means nothing runs either (looked at after releasing it, the
                # thread could have popped an op and be running it).
                with self._cond:
                    if not self._queue:
                        return
            finally:
                self._busy.release()
            with self._cond:
                if self._queue:
                    self._cond.wait(0.001)  # the thread is about to take it
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self._name}: operations still queued after {timeout:g} s")

    def stop(self, timeout: float) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and threading.current_thread() is not thread:
            thread.join(timeout)


class PeerExecutors:
    """Lazily created executors, one per (peer, "send" | "recv")."""

    def __init__(self, prefix: str, completer: Completer,
                 describe_error: Callable[[str, BaseException], BaseException]) -> None:
        self._prefix = prefix
        self._completer = completer
        self._describe_error = describe_error
        self._lock = threading.Lock()
        self._executors: dict[tuple[int, str], Executor] = {}

    def get(self, peer: int, direction: str) -> Executor:
        with self._lock:
            executor = self._executors.get((peer, direction))
            if executor is None:
                executor = Executor(f"{self._prefix}-{direction}-{peer}", self._completer, self._describe_error)
                self._executors[(peer, direction)] = executor
            return executor

    def stop(self, timeout: float) -> None:
        with self._lock:
            executors = list(self._executors.values())
            self._executors.clear()
        for executor in executors:
            executor.stop(timeout)
