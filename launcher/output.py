"""Where rank output goes: the terminal (each line prefixed `[rank] `, stderr kept on
stderr), or raw with --no-prefix, and optionally one log file per rank (--log-dir).

Output is assembled into lines per (rank, stream) so that ranks never interleave inside a
line; a partial line (a prompt such as "(Pdb) ") is shown once it waited PARTIAL_LINE_DELAY.
"""

from __future__ import annotations

import os
import select
import time
from pathlib import Path
from typing import Optional

PARTIAL_LINE_DELAY = 0.1


class _Stream:
    """Line assembly for one (rank, stdout|stderr) pair."""

    def __init__(self) -> None:
        self.pending = b""
        self.since = 0.0
        self.mid_line = False  # part of the current line was already shown


class OutputRouter:
    def __init__(self, prefix: bool = True, log_dir: Optional[Path] = None,
                 stdout_fd: int = 1, stderr_fd: int = 2) -> None:
        self.prefix = prefix
        self.log_dir = Path(log_dir) if log_dir else None
        # Raw fds, not sys.stdout: the writer thread may be blocked in a write (a paused
        # `| less`) when the launcher exits, and a buffered object's lock would then abort
        # interpreter shutdown.
        self.targets = {1: stdout_fd, 2: stderr_fd}
        self.broken: set[int] = set()
        self.streams: dict[tuple, _Stream] = {}
        self.logs: dict = {}
        self.open_line: dict[int, Optional[tuple]] = {1: None, 2: None}  # who is mid-line
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)

    def start_logs(self, ranks) -> None:
        """Create (truncate) every rank's log now: each run overwrites the previous run's
        files, and a rank that prints nothing still gets an (empty) log."""
        if not self.log_dir:
            return
        for rank in ranks:
            self._log(rank)

    def log_path(self, rank) -> Optional[Path]:
        """DIR/rank<N>.log (mpirun's own messages: DIR/mpirun.log)."""
        if not self.log_dir:
            return None
        return self.log_dir / (f"rank{rank}.log" if isinstance(rank, int) else f"{rank}.log")

    def write(self, rank, fd: int, data: bytes) -> None:
        if not self.prefix:
            self._emit(fd, data)  # raw and immediate; lines are still assembled for the log
            if not self.log_dir:
                return
        stream = self.streams.setdefault((rank, fd), _Stream())
        if not stream.pending:
            stream.since = time.monotonic()
        stream.pending += data
        complete, sep, rest = stream.pending.rpartition(b"\n")
        if sep:
            stream.pending = rest
            stream.since = time.monotonic()
            self._show(rank, fd, stream, complete + b"\n", ends_line=True)

    def flush_partials(self, force: bool = False) -> None:
        """Show partial lines that waited long enough (prompts), or all when forced."""
        now = time.monotonic()
        for (rank, fd), stream in list(self.streams.items()):
            if stream.pending and (force or now - stream.since >= PARTIAL_LINE_DELAY):
                data, stream.pending = stream.pending, b""
                self._show(rank, fd, stream, data, ends_line=False)

    def end_rank(self, rank) -> None:
        """The rank is gone: show its unfinished lines, each closed with a newline."""
        for fd in (1, 2):
            stream = self.streams.get((rank, fd))
            if stream is not None and (stream.pending or stream.mid_line):
                data, stream.pending = stream.pending + b"\n", b""
                self._show(rank, fd, stream, data, ends_line=True)

    def close(self) -> None:
        for rank, _fd in list(self.streams):
            self.end_rank(rank)
        for log in self.logs.values():
            log.close()
        self.logs.clear()

    def _show(self, rank, fd: int, stream: _Stream, data: bytes, ends_line: bool) -> None:
        """Deliver assembled text: to the log unchanged, to the terminal with prefixes."""
        if self.log_dir:
            log = self._log(rank)
            log.write(data)
            log.flush()
        if self.prefix:
            key = (rank, fd)
            self._claim(fd, key)
            tag = self._tag(rank)
            lines = data.splitlines(keepends=True)
            out = [line if (i == 0 and stream.mid_line) else tag + line
                   for i, line in enumerate(lines)]
            self._emit(fd, b"".join(out))
            self.open_line[fd] = None if ends_line else key
        stream.mid_line = not ends_line

    def _log(self, rank):
        log = self.logs.get(rank)
        if log is None:
            log = self.logs[rank] = open(self.log_path(rank), "wb")
        return log

    def _claim(self, fd: int, key: tuple) -> None:
        """Before `key` writes to fd, end another rank's partial line so text never glues."""
        owner = self.open_line[fd]
        if owner is not None and owner != key:
            self._emit(fd, b"\n")
            self.streams[owner].mid_line = False
            self.open_line[fd] = None

    @staticmethod
    def _tag(rank) -> bytes:
        return f"[{rank}] ".encode()

    def _emit(self, fd: int, data: bytes) -> None:
        if fd in self.broken:
            return
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.targets[fd], view):]
            except BlockingIOError:  # an O_NONBLOCK terminal shared with another program
                select.select([], [self.targets[fd]], [], 1.0)
            except OSError:
                self.broken.add(fd)  # a closed terminal or `| head` must not stop the job
                return
