"""Where rank output goes: the terminal (each line prefixed `[rank] `, stderr kept on
stderr), or raw with --no-prefix, and optionally one log file per rank (--log-dir).

Output is assembled into lines per (rank, stream) so that ranks never interleave inside a
line; a partial line (a prompt such as "(Pdb) ") is shown once it waited PARTIAL_LINE_DELAY.
Carriage returns (progress bars) rewrite the line, prefix included, on a terminal; pipes and
log files get only each line's final state. A log file that cannot be written (a full disk)
is closed and reported once; the terminal keeps getting everything.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Optional

PARTIAL_LINE_DELAY = 0.1


def final_state(line: bytes) -> bytes:
    """What a terminal would show at the end of a line with carriage returns (a progress
    bar's updates): the last non-empty segment. Progress bars pad each update to cover the
    previous one, so the last segment is the whole final state."""
    if b"\r" not in line:
        return line
    segments = [seg for seg in line.split(b"\r") if seg]
    return segments[-1] if segments else b""


def _compact(pending: bytes) -> bytes:
    """An unfinished line with carriage returns, reduced to its latest state (memory stays
    bounded however long a bar runs without a newline)."""
    segments = pending.split(b"\r")
    if len(segments) <= 2:
        return pending
    filled = [i for i, seg in enumerate(segments) if seg]
    if not filled:
        return b"\r"
    last = filled[-1]
    return b"\r" + segments[last] + (b"\r" if last < len(segments) - 1 else b"")


def _same_file(fd_a: int, fd_b: int) -> bool:
    try:
        a, b = os.fstat(fd_a), os.fstat(fd_b)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _is_terminal(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def write_all(fd: int, data: bytes) -> bool:
    """Write all of data to fd; False when fd is broken (a closed terminal, `| head`)."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:  # an O_NONBLOCK terminal shared with another program
            select.select([], [fd], [], 1.0)
        except OSError:
            return False
    return True


class FdWriter:
    """The writes to one target fd, on a thread of their own: a stdout that nobody reads
    (`| less` paused) holds back neither stderr nor the launcher. put() never blocks; the
    caller bounds what is queued (after() tells it when its bytes are out)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.items: deque = deque()  # bytes, or a callable to run once all before it is out
        self.queued = 0              # bytes put but not written yet
        self.written = 0             # bytes written so far (progress, for the supervisor)
        self.broken = False
        self.closed = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"write-fd{fd}")
        self.thread.start()

    def put(self, data: bytes) -> None:
        if data:
            with self.cond:
                self.items.append(data)
                self.queued += len(data)
                self.cond.notify()

    def after(self, callback: Callable[[], None]) -> None:
        with self.cond:
            self.items.append(callback)
            self.cond.notify()

    def close(self) -> None:
        """Write what is queued, then end the thread."""
        with self.cond:
            self.closed = True
            self.cond.notify()

    def join(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.items and not self.closed:
                    self.cond.wait()
                if not self.items:
                    return
                item = self.items.popleft()
            if callable(item):
                item()
                continue
            if not self.broken and not write_all(self.fd, item):
                self.broken = True  # a closed terminal or `| head` must not stop the job
            with self.cond:
                self.queued -= len(item)
                self.written += len(item)


class _Stream:
    """Line assembly for one (rank, stdout|stderr) pair."""

    def __init__(self) -> None:
        self.pending = b""
        self.since = 0.0
        self.mid_line = False  # part of the current line was already shown
        self.log_pending = b""  # the log's own assembly: it gets whole lines only


class OutputRouter:
    def __init__(self, prefix: bool = True, log_dir: Optional[Path] = None,
                 stdout_fd: int = 1, stderr_fd: int = 2) -> None:
        self.prefix = prefix
        self.log_dir = Path(log_dir) if log_dir else None
        # Raw fds, not sys.stdout: the writer thread may be blocked in a write (a paused
        # `| less`) when the launcher exits, and a buffered object's lock would then abort
        # interpreter shutdown.
        self.targets = {1: stdout_fd, 2: stderr_fd}
        self.writers: dict[int, FdWriter] = {}  # set by use_writers(): writes off this thread
        # A terminal shows carriage-return updates in place; a pipe or file gets only the
        # final state of each line.
        self.terminal = {fd: _is_terminal(target) for fd, target in self.targets.items()}
        # stdout and stderr on one terminal (or file) share its current line
        self.same_target = _same_file(stdout_fd, stderr_fd)
        # A file or pipe taking both (`> log 2>&1`): the ranks write both into one pipe, so
        # each rank's lines keep its order. A terminal keeps two streams, which the line
        # claiming below keeps from gluing a line to a progress bar's.
        self.one_stream = self.same_target and not self.terminal[1]
        self.broken: set[int] = set()
        self.streams: dict[tuple, _Stream] = {}
        self.logs: dict = {}
        self.failed_logs: dict = {}    # rank -> why its log was closed
        self.failures: list[str] = []  # log failures not yet reported (the supervisor takes them)
        self.open_line: dict[int, Optional[tuple]] = {1: None, 2: None}  # who is mid-line
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)

    def use_writers(self) -> dict[int, FdWriter]:
        """From now on write through one FdWriter per target (one for both when stdout and
        stderr are the same file, which keeps their lines in order). Returns {1: w, 2: w}."""
        first = FdWriter(self.targets[1])
        self.writers = {1: first, 2: first if self.same_target else FdWriter(self.targets[2])}
        return self.writers

    def start_logs(self, ranks) -> None:
        """Create (truncate) every rank's log now: each run overwrites the previous run's
        files, and a rank that prints nothing still gets an (empty) log."""
        if not self.log_dir:
            return
        for rank in ranks:
            self.logs[rank] = self._open_log(rank)

    def log_path(self, rank) -> Optional[Path]:
        """DIR/rank<N>.log (mpirun's own messages: DIR/mpirun.log)."""
        if not self.log_dir:
            return None
        return self.log_dir / (f"rank{rank}.log" if isinstance(rank, int) else f"{rank}.log")

    def take_failures(self) -> list[str]:
        """Log failures since the last call, one message each (each file fails once)."""
        failures, self.failures = self.failures, []
        return failures

    def write(self, rank, fd: int, data: bytes) -> None:
        stream = self.streams.setdefault((rank, fd), _Stream())
        if self.log_dir:
            self._log_lines(rank, stream, data)
        if not self.prefix:
            self._emit(fd, data)  # raw and immediate
            return
        if not stream.pending:
            stream.since = time.monotonic()
        stream.pending += data
        complete, sep, rest = stream.pending.rpartition(b"\n")
        if sep:
            stream.pending = rest
            stream.since = time.monotonic()
            self._show(rank, fd, stream, complete + b"\n", ends_line=True)
        if b"\r" in stream.pending:
            stream.pending = _compact(stream.pending)

    def flush_partials(self, force: bool = False) -> None:
        """Show partial lines that waited long enough (prompts, a bar's latest state on a
        terminal), or all when forced. A pipe never gets a bar's intermediate states."""
        if not self.prefix:
            return
        now = time.monotonic()
        for (rank, fd), stream in list(self.streams.items()):
            if not stream.pending or not (force or now - stream.since >= PARTIAL_LINE_DELAY):
                continue
            if b"\r" in stream.pending and not self.terminal[fd] and not force:
                continue  # held until the line ends: only its final state goes to a pipe
            data, stream.pending = stream.pending, b""
            stream.since = now
            self._show(rank, fd, stream, data, ends_line=False)

    def input_echoed(self) -> None:
        """The user typed a line into the terminal (an answer to a pdb prompt): its echo ended
        the terminal's current line, so whatever a rank writes next starts a line of its own,
        with its prefix, even if it continues a line the rank had left open (the prompt)."""
        for fd in (1, 2):
            owner = self.open_line[fd]
            if owner is not None:
                self.streams[owner].mid_line = False
                self.open_line[fd] = None

    def end_rank(self, rank) -> None:
        """The rank is gone: show its unfinished lines, each closed with a newline."""
        for fd in (1, 2):
            stream = self.streams.get((rank, fd))
            if stream is None:
                continue
            if self.log_dir and stream.log_pending:
                self._log_lines(rank, stream, b"\n")
            if self.prefix and (stream.pending or stream.mid_line):
                data, stream.pending = stream.pending + b"\n", b""
                self._show(rank, fd, stream, data, ends_line=True)

    def close(self) -> None:
        for rank, _fd in list(self.streams):
            self.end_rank(rank)
        for rank in list(self.logs):
            self._close_log(rank)

    # ---- the terminal (or whatever stdout/stderr are) ---------------------------------------

    def _show(self, rank, fd: int, stream: _Stream, data: bytes, ends_line: bool) -> None:
        """Deliver assembled text with one prefix per displayed line."""
        key = (rank, fd)
        self._claim(fd, key)
        tag = self._tag(rank)
        out = []
        lines = data.split(b"\n")
        for i, body in enumerate(lines):
            last = i == len(lines) - 1
            if last and not body:
                break  # data ended with a newline
            out.append(self._render(fd, body, tag, continuing=(i == 0 and stream.mid_line)))
            if not last:
                out.append(b"\n")
        self._emit(fd, b"".join(out))
        self.open_line[fd] = None if ends_line else key
        stream.mid_line = not ends_line

    def _render(self, fd: int, body: bytes, tag: bytes, continuing: bool) -> bytes:
        """One displayed line. On a terminal each carriage return rewrites the line, prefix
        included; elsewhere only the line's final state is written."""
        if b"\r" not in body:
            return body if continuing else tag + body
        if not self.terminal[fd]:
            final = final_state(body)
            return (b"\n" + tag + final) if continuing else tag + final
        segments = body.split(b"\r")
        head = segments[0] if continuing or segments[0] else None
        parts = [] if head is None else [head if continuing else tag + head]
        parts.extend(b"\r" + tag + seg for seg in segments[1:])
        return b"".join(parts)

    def _claim(self, fd: int, key: tuple) -> None:
        """Before `key` writes to fd, end another stream's partial line so text never glues
        (a bar on stderr and a line on stdout meet on one terminal line too)."""
        for other in ((1, 2) if self.same_target else (fd,)):
            owner = self.open_line[other]
            if owner is not None and owner != key:
                self._emit(other, b"\n")
                self.streams[owner].mid_line = False
                self.open_line[other] = None

    @staticmethod
    def _tag(rank) -> bytes:
        return f"[{rank}] ".encode()

    def _emit(self, fd: int, data: bytes) -> None:
        if fd in self.writers:
            self.writers[fd].put(data)
            return
        if fd in self.broken:
            return
        if not write_all(self.targets[fd], data):
            self.broken.add(fd)  # a closed terminal or `| head` must not stop the job

    # ---- --log-dir files --------------------------------------------------------------------

    def _log_lines(self, rank, stream: _Stream, data: bytes) -> None:
        """Whole lines to the rank's log, each in its final state (no progress-bar frames)."""
        stream.log_pending += data
        complete, sep, rest = stream.log_pending.rpartition(b"\n")
        if b"\r" in rest:
            rest = _compact(rest)
        stream.log_pending = rest
        if sep:
            lines = complete.split(b"\n")
            self._log_write(rank, b"".join(final_state(line) + b"\n" for line in lines))

    def _open_log(self, rank):
        # Unbuffered: a failed write fails here, once, not again at every flush and at close.
        return open(self.log_path(rank), "wb", buffering=0)

    def _log_write(self, rank, data: bytes) -> None:
        if rank in self.failed_logs or not data:
            return
        try:
            log = self.logs.get(rank)
            if log is None:
                log = self.logs[rank] = self._open_log(rank)
            view = memoryview(data)
            while view:
                view = view[log.write(view):]
        except OSError as e:
            self._close_log(rank)
            why = e.strerror or str(e)
            self.failed_logs[rank] = why
            self.failures.append(f"--log-dir: cannot write {self.log_path(rank)} ({why}); closed it, "
                                 f"rank {rank}'s output still goes to the terminal")

    def _close_log(self, rank) -> None:
        log = self.logs.pop(rank, None)
        if log is not None:
            try:
                log.close()
            except OSError:
                pass
