"""Point-to-point receives of the jacklring process group: one Inbox per peer matches that
peer's messages to posted recvs by tag (any tag order, as gloo), and a recv from any source is
offered to every peer's Inbox (AnySource)."""
from __future__ import annotations

import collections
import threading
from typing import Any, Callable

from ..errors import CollectiveTimeout, DistributedError
from .executors import Completer
from .work import JacklringWork


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
