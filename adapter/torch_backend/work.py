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
import datetime
import gc
import sys
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import CULPRIT_MARK, CollectiveTimeout, DistributedError, culprit_of, failure_of, with_failure


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


class AnySource:
    """One recv from any source, posted to every peer's Inbox: the first Inbox whose peer sends
    a message with its tag claims it (and names that peer as the Work's source rank); the
    other Inboxes drop it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken = False

    @property
    def taken(self) -> bool:
        return self._taken

    def claim(self, peer: int, work: JacklringWork) -> bool:
        with self._lock:
            if self._taken:
                return False
            self._taken = True
        work._set_source_rank(peer)
        return True


class PostedRecv:
    __slots__ = ("work", "tag", "array", "done", "any_source")

    def __init__(self, work: JacklringWork, tag: int, array: Any, done: Callable[[], None],
                 any_source: AnySource | None = None) -> None:
        self.work, self.tag, self.array, self.done = work, tag, array, done
        self.any_source = any_source

    def live(self) -> bool:
        return self.any_source is None or not self.any_source.taken


class Inbox:
    """One peer's incoming point-to-point messages, matched to posted recvs by tag.

    While recvs are posted, a thread reads the peer's messages in order (envelope, then
    payload): each goes to the first posted recv with its tag, or, when none is posted yet, into
    a stash that a later recv with that tag takes it from. Recvs posted in any tag order thus
    complete as they do on gloo. A recv from any source is posted to every peer's Inbox and
    taken by the first matching message. After a transport error every pending and later recv
    fails with it (the stream can no longer be trusted); a deadline that passes while no recv
    is waiting on this peer (only a recv from any source that another peer satisfied) is not
    an error."""

    def __init__(self, name: str, peer: int, read_envelope: Callable[[], Any],
                 read_payload: Callable[[Any, Any], Any], check: Callable[[Any, Any, int], None],
                 completer: Completer, describe_error: Callable[[str, BaseException], BaseException]) -> None:
        self._name = name
        self._peer = peer
        self._read_envelope = read_envelope
        self._read_payload = read_payload  # (envelope, array or None) -> the bytes received
        self._check = check  # (envelope, array, tag): raise when the message does not fit the recv
        self._completer = completer
        self._describe_error = describe_error
        self._cond = threading.Condition()
        self._posted: list[PostedRecv] = []
        self._stash: dict[int, collections.deque] = {}
        self._broken: BaseException | None = None
        self._failed: list[PostedRecv] = []
        self._dropped_tags: set[int] = set()  # tags of abandoned recvs: their late messages are read and dropped
        self._stopped = False
        self._thread: threading.Thread | None = None

    def post(self, work: JacklringWork, tag: int, array: Any, done: Callable[[], None]) -> JacklringWork:
        """Receive the next message with `tag` into `array` (1-D numpy), then call done()."""
        entry = PostedRecv(work, tag, array, done)
        with self._cond:
            broken = self._broken
            if broken is None:
                stashed = self._stash.get(tag)
                if not stashed:
                    self._append(entry)
                    return work
                envelope, payload = stashed.popleft()
        if broken is not None:
            self._finish(entry, DistributedError(f"the connection from this peer failed earlier: {broken}"))
        else:
            self._deliver_stashed(entry, envelope, payload)
        return work

    def post_any(self, entry: PostedRecv) -> str:
        """Offer a recv from any source: "taken" (a stashed message of this peer or an earlier
        claim satisfied it), "posted", or "broken" (this peer's stream failed earlier)."""
        assert entry.any_source is not None
        with self._cond:
            if entry.any_source.taken:
                return "taken"
            if self._broken is not None:
                return "broken"
            stashed = self._stash.get(entry.tag)
            if not stashed:
                self._append(entry)
                return "posted"
            if not entry.any_source.claim(self._peer, entry.work):
                return "taken"
            envelope, payload = stashed.popleft()
        self._deliver_stashed(entry, envelope, payload)
        return "taken"

    def abandon(self, work: JacklringWork, reason: str) -> bool:
        """Give up on a posted recv whose tag is never used again (a monitored barrier's): it
        fails with `reason`, and a message with its tag that arrives later is read and dropped,
        so it can neither complete a later recv nor wait in the stash. False when a message
        had already been matched to it (it completes as usual)."""
        with self._cond:
            entry = next((e for e in self._posted if e.work is work), None)
            if entry is None:
                return False
            self._posted.remove(entry)
            self._dropped_tags.add(entry.tag)
            self._stash.pop(entry.tag, None)
        self._finish(entry, DistributedError(reason))
        return True

    def _append(self, entry: PostedRecv) -> None:
        """Called with the lock held."""
        self._posted.append(entry)
        self._cond.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()

    def _deliver_stashed(self, entry: PostedRecv, envelope: Any, payload: Any) -> None:
        try:
            self._check(envelope, entry.array, entry.tag)
            entry.array.view("uint8")[...] = payload
            entry.done()
        except BaseException as exc:
            self._finish(entry, exc)
            return
        self._finish(entry, None)

    def _has_live(self) -> bool:
        """Drop recvs from any source that another peer satisfied. Called with the lock held."""
        self._posted = [entry for entry in self._posted if entry.live()]
        return bool(self._posted)

    def _take_posted(self, tag: int) -> PostedRecv | None:
        """The first posted recv this message may complete (claimed when from any source)."""
        for i, entry in enumerate(self._posted):
            if entry.tag != tag:
                continue
            if entry.any_source is None or entry.any_source.claim(self._peer, entry.work):
                return self._posted.pop(i)
        return None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._has_live() and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
            try:
                envelope = self._read_envelope()
            except CollectiveTimeout as exc:
                with self._cond:
                    if not self._has_live():
                        continue  # nobody was waiting on this peer any more: not a failure
                self._fail_all(exc)
                return
            except BaseException as exc:
                self._fail_all(exc)
                return
            try:
                self._receive(envelope)
            except BaseException as exc:
                self._fail_all(exc)
                return

    def _receive(self, envelope: Any) -> PostedRecv | None:
        """Read one message; returns the recv it completed, if any."""
        with self._cond:
            entry = self._take_posted(envelope.tag)
        if entry is None:
            payload = self._read_payload(envelope, None)
            with self._cond:  # a recv for this tag may have been posted meanwhile
                entry = self._take_posted(envelope.tag)
                if entry is None:
                    if envelope.tag not in self._dropped_tags:
                        self._stash.setdefault(envelope.tag, collections.deque()).append((envelope, payload))
                    return None
            self._deliver_stashed(entry, envelope, payload)
            return entry
        try:
            self._check(envelope, entry.array, entry.tag)
        except BaseException as exc:
            self._read_payload(envelope, None)  # drain it: the stream stays aligned
            self._finish(entry, exc)
            return entry
        try:
            self._read_payload(envelope, entry.array)
            entry.done()
        except BaseException as exc:
            self._finish(entry, exc)
            self._failed.append(entry)
            raise
        self._finish(entry, None)
        return entry

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self._broken = exc
            pending, self._posted = self._posted, []
        self._failed.extend(pending)  # referenced by the Inbox, not freed by this ending thread
        for entry in pending:
            if entry.any_source is None or entry.any_source.claim(self._peer, entry.work):
                self._finish(entry, exc)

    def _finish(self, entry: PostedRecv, error: BaseException | None) -> None:
        entry.work._finish(None if error is None else self._describe_error(entry.work._what, error))
        # Free the staging buffers now, before the Work can complete: once it has, the main
        # thread may exit, and a daemon thread that frees a tensor while the interpreter shuts
        # down is aborted inside torch (std::terminate, SIGABRT).
        entry.array = entry.done = None
        self._completer.put(entry.work)

    def finish(self, entry: PostedRecv, error: BaseException) -> None:
        """Fail a recv that could not be posted anywhere."""
        self._finish(entry, error)

    def stop(self) -> None:
        """Let the thread end; one blocked in a read ends when the communicator is closed."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def join(self, timeout: float) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


def torch_flavoured(cls: type) -> type:
    """`cls` that is also a torch.distributed.DistBackendError, the class c10d's own backends
    raise, so `except dist.DistBackendError` catches jacklring's errors too. The classes keep the
    jacklring name (PeerError, ...) and are module attributes (TorchPeerError, ...) so they pickle."""
    if issubclass(cls, dist.DistBackendError):
        return cls
    name = f"Torch{cls.__name__}"
    flavoured = globals().get(name)
    if flavoured is None:
        flavoured = type(cls.__name__, (cls, dist.DistBackendError), {"__module__": __name__, "__doc__": cls.__doc__})
        flavoured.__qualname__ = name  # pickled by this name; shown as the jacklring class's name
        globals()[name] = flavoured
    return flavoured


def wrap_error(rank: int, group: str, what: str, exc: BaseException,
               deadline_s: float | None = None) -> BaseException:
    """A DistributedError (also a DistBackendError) naming rank, group and operation, chained
    to the cause. Timeouts carry torch's wording ("Timed out waiting <n>ms for ...") next to
    ours, as gloo's do, so what users and torch's tests match on is there."""
    if isinstance(exc, dist.DistBackendError) and f"rank {rank}" in str(exc) and what in str(exc):
        return exc
    cls = type(exc) if isinstance(exc, DistributedError) else DistributedError
    detail = str(exc)
    if isinstance(exc, TimeoutError) and "Timed out" not in detail:
        waited = f"waiting {deadline_s * 1000:.0f}ms " if deadline_s else ""
        detail = f"Timed out {waited}for {what} to complete: {detail}"
    message = f"rank {rank}: jacklring {what} (group {group!r}) failed: {detail}"
    culprit = culprit_of(exc)
    if culprit is not None and CULPRIT_MARK.format(culprit) not in message:
        # The marker survives where torch re-raises only the text (DDP's reducer, futures).
        message = f"{message} {CULPRIT_MARK.format(culprit)}"
    try:
        wrapped = torch_flavoured(cls)(message)
    except TypeError:
        wrapped = torch_flavoured(DistributedError)(message)
    wrapped.__cause__ = exc
    # The cause's failure record (the rank blamed, the link that failed), with the culprit found
    # along its chain.
    record = failure_of(exc)
    return with_failure(wrapped, record, culprit=record.culprit if culprit is None else culprit)
