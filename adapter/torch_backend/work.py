"""Asynchronous execution for the torch "jacklring" process group.

- Collectives run in issue order on one communication thread per process group, so the
  caller (DDP's autograd hooks) returns at once and backward overlaps communication.
- Point-to-point sends run on one worker thread per peer (messages to a peer stay in order);
  receives from a peer are matched by tag on an Inbox thread of their own, so an irecv posted
  before the matching isend cannot block the send, and recvs may be posted in any tag order.
- Futures are completed on a separate completion thread, never on a communication thread:
  a `.then` callback that issues (and even waits for) a new collective, as PowerSGD does,
  runs while the communication thread is free to execute it.
"""
from __future__ import annotations

import collections
import datetime
import queue
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeout, DistributedError

_STOP = object()


class JacklringWork(dist.Work):
    """The handle torch gets back from every operation of the jacklring process group."""

    def __init__(self, what: str, result: list[torch.Tensor], source_rank: int = -1) -> None:
        super().__init__()
        self._what = what
        self._result = result
        self._source_rank = source_rank
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future = torch.futures.Future()

    # ---- called by the executors ----------------------------------------------------------

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def _complete_future(self) -> None:
        if self._error is None:
            self._future.set_result(self._result)
        else:
            self._future.set_exception(self._error)

    # ---- torch's Work interface -----------------------------------------------------------

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        seconds = _seconds(timeout)
        if not self._done.wait(seconds):
            raise CollectiveTimeout(f"{self._what} did not finish within {seconds:g} s (Work.wait timeout)")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        return self._future

    def source_rank(self) -> int:
        return self._source_rank

    def synchronize(self) -> None:
        """CPU work has no stream to synchronise with."""

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else ("ok" if self._error is None else "failed")
        return f"<JacklringWork {self._what} {state}>"


def _seconds(timeout: datetime.timedelta | float | None) -> float | None:
    """torch passes timedelta(0) (kNoTimeout) for "wait forever"."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return seconds if seconds > 0 else None


class Completer:
    """Completes futures (runs user callbacks) off the communication threads.

    Completions run in finishing order on one thread while callbacks return promptly. A
    callback that blocks (PowerSGD's waits on the future of a collective it just issued)
    would starve every later completion, including the one it waits for; so when no worker
    is idle another is started (at most MAX_WORKERS) to keep completions flowing."""

    MAX_WORKERS = 32

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._pending: collections.deque = collections.deque()
        self._idle = 0
        self._workers: list[threading.Thread] = []
        self._stopped = False

    def put(self, work: JacklringWork) -> None:
        with self._cond:
            self._pending.append(work)
            if self._idle > 0:
                self._cond.notify()
            elif len(self._workers) < self.MAX_WORKERS and not self._stopped:
                worker = threading.Thread(target=self._loop, name=f"{self._name}-complete{len(self._workers)}",
                                          daemon=True)
                self._workers.append(worker)
                worker.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopped:
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                if not self._pending:
                    return
                work = self._pending.popleft()
            try:
                work._complete_future()
            except BaseException:  # a failing user callback must not stop later completions
                pass

    def stop(self, timeout: float) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            workers = list(self._workers)
        for worker in workers:
            if worker is not threading.current_thread():
                worker.join(timeout)


class Executor:
    """A FIFO of operations run on one daemon thread; each finishes its Work and hands it to
    the completer. describe_error turns an exception into one that names rank and operation."""

    def __init__(self, name: str, completer: Completer,
                 describe_error: Callable[[str, BaseException], BaseException]) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._completer = completer
        self._describe_error = describe_error
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: JacklringWork, run: Callable[[], Any]) -> JacklringWork:
        self._queue.put((work, run))
        return work

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            work, run = item
            try:
                run()
                error = None
            except BaseException as exc:  # surfaces in wait() / the future, never lost
                error = self._describe_error(work._what, exc)
            work._finish(error)
            self._completer.put(work)

    def stop(self, timeout: float) -> None:
        self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


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


class _Posted:
    __slots__ = ("work", "tag", "array", "done")

    def __init__(self, work: JacklringWork, tag: int, array: Any, done: Callable[[], None]) -> None:
        self.work, self.tag, self.array, self.done = work, tag, array, done


class Inbox:
    """One peer's incoming point-to-point messages, matched to posted recvs by tag.

    While recvs are posted, a thread reads the peer's messages in order (envelope, then
    payload): each goes to the first posted recv with its tag, or, when none is posted yet, into
    a stash that a later recv with that tag takes it from. Recvs posted in any tag order thus
    complete as they do on gloo. After a transport error every pending and later recv fails
    with it (the stream can no longer be trusted)."""

    def __init__(self, name: str, read_envelope: Callable[[], Any], read_payload: Callable[[Any, Any], Any],
                 check: Callable[[Any, Any, int], None], completer: Completer,
                 describe_error: Callable[[str, BaseException], BaseException]) -> None:
        self._name = name
        self._read_envelope = read_envelope
        self._read_payload = read_payload  # (envelope, array or None) -> the bytes received
        self._check = check  # (envelope, array, tag): raise when the message does not fit the recv
        self._completer = completer
        self._describe_error = describe_error
        self._cond = threading.Condition()
        self._posted: list[_Posted] = []
        self._stash: dict[int, collections.deque] = {}
        self._broken: BaseException | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None

    def post(self, work: JacklringWork, tag: int, array: Any, done: Callable[[], None]) -> JacklringWork:
        """Receive the next message with `tag` into `array` (1-D numpy), then call done()."""
        entry = _Posted(work, tag, array, done)
        with self._cond:
            if self._broken is not None:
                broken = self._broken
            else:
                broken = None
                stashed = self._stash.get(tag)
                if not stashed:
                    self._posted.append(entry)
                    self._cond.notify()
                    if self._thread is None:
                        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                        self._thread.start()
                    return work
                envelope, payload = stashed.popleft()
        if broken is not None:
            self._finish(entry, DistributedError(f"the connection from this peer failed earlier: {broken}"))
        else:
            self._deliver_stashed(entry, envelope, payload)
        return work

    def _deliver_stashed(self, entry: _Posted, envelope: Any, payload: Any) -> None:
        try:
            self._check(envelope, entry.array, entry.tag)
            entry.array.view("uint8")[...] = payload
            entry.done()
        except BaseException as exc:
            self._finish(entry, exc)
            return
        self._finish(entry, None)

    def _take_posted(self, tag: int) -> _Posted | None:
        for i, entry in enumerate(self._posted):
            if entry.tag == tag:
                return self._posted.pop(i)
        return None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._posted and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
            try:
                envelope = self._read_envelope()
                with self._cond:
                    entry = self._take_posted(envelope.tag)
                if entry is None:
                    payload = self._read_payload(envelope, None)
                    with self._cond:  # a recv for this tag may have been posted meanwhile
                        entry = self._take_posted(envelope.tag)
                        if entry is None:
                            self._stash.setdefault(envelope.tag, collections.deque()).append((envelope, payload))
                            continue
                    self._deliver_stashed(entry, envelope, payload)
                    continue
                try:
                    self._check(envelope, entry.array, entry.tag)
                except BaseException as exc:
                    self._read_payload(envelope, None)  # drain it: the stream stays aligned
                    self._finish(entry, exc)
                    continue
                try:
                    self._read_payload(envelope, entry.array)
                    entry.done()
                except BaseException as exc:
                    self._finish(entry, exc)
                    raise
                self._finish(entry, None)
            except BaseException as exc:
                self._fail_all(exc)
                return

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self._broken = exc
            pending, self._posted = self._posted, []
        for entry in pending:
            self._finish(entry, exc)

    def _finish(self, entry: _Posted, error: BaseException | None) -> None:
        entry.work._finish(None if error is None else self._describe_error(entry.work._what, error))
        self._completer.put(entry.work)

    def stop(self) -> None:
        """Let the thread end; one blocked in a read ends when the communicator is closed."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


def wrap_error(rank: int, group: str, what: str, exc: BaseException) -> BaseException:
    """A DistributedError naming rank, group and operation, chained to the cause."""
    if isinstance(exc, DistributedError) and f"rank {rank}" in str(exc) and what in str(exc):
        return exc
    cls = type(exc) if isinstance(exc, DistributedError) else DistributedError
    try:
        wrapped = cls(f"rank {rank}: jacklring {what} (group {group!r}) failed: {exc}")
    except TypeError:
        wrapped = DistributedError(f"rank {rank}: jacklring {what} (group {group!r}) failed: {exc}")
    wrapped.__cause__ = exc
    return wrapped
