"""Where rank output goes: the terminal (each line prefixed `[rank] `, stderr kept on
stderr), or raw with --no-prefix, and optionally one log file per rank (--log-dir)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import BinaryIO, Optional

PARTIAL_LINE_DELAY = 0.1  # a prompt without newline ("(Pdb) ") shows after this long


class _Stream:
    """Line assembly for one (rank, stdout|stderr) pair."""

    def __init__(self) -> None:
        self.pending = b""
        self.since = 0.0
        self.mid_line = False  # a partial line was already shown with its prefix


class OutputRouter:
    def __init__(self, prefix: bool = True, log_dir: Optional[Path] = None,
                 stdout: Optional[BinaryIO] = None, stderr: Optional[BinaryIO] = None) -> None:
        self.prefix = prefix
        self.log_dir = Path(log_dir) if log_dir else None
        self.targets = {1: stdout or sys.stdout.buffer, 2: stderr or sys.stderr.buffer}
        self.streams: dict[tuple[int, int], _Stream] = {}
        self.logs: dict[int, BinaryIO] = {}
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)

    def log_path(self, rank) -> Optional[Path]:
        """DIR/rank<N>.log (mpirun's own messages: DIR/mpirun.log)."""
        if not self.log_dir:
            return None
        return self.log_dir / (f"rank{rank}.log" if isinstance(rank, int) else f"{rank}.log")

    def write(self, rank: int, fd: int, data: bytes) -> None:
        if self.log_dir:
            log = self.logs.get(rank)
            if log is None:
                log = self.logs[rank] = open(self.log_path(rank), "ab")
            log.write(data)
            log.flush()
        if not self.prefix:
            self._emit(fd, data)
            return
        stream = self.streams.setdefault((rank, fd), _Stream())
        if not stream.pending:
            stream.since = time.monotonic()
        stream.pending += data
        complete, sep, rest = stream.pending.rpartition(b"\n")
        if sep:
            out = []
            for line in (complete + b"\n").splitlines(keepends=True):
                out.append(line if stream.mid_line else self._tag(rank) + line)
                stream.mid_line = False
            self._emit(fd, b"".join(out))
            stream.pending = rest
            stream.since = time.monotonic()

    def flush_partials(self, force: bool = False) -> None:
        """Show partial lines that waited long enough (prompts), or all when forced."""
        now = time.monotonic()
        for (rank, fd), stream in self.streams.items():
            if stream.pending and (force or now - stream.since >= PARTIAL_LINE_DELAY):
                head = b"" if stream.mid_line else self._tag(rank)
                self._emit(fd, head + stream.pending)
                stream.pending = b""
                stream.mid_line = True

    def close(self) -> None:
        self.flush_partials(force=True)
        for (rank, fd), stream in self.streams.items():
            if stream.mid_line:
                self._emit(fd, b"\n")  # do not glue the next message onto a rank's last words
                stream.mid_line = False
        for log in self.logs.values():
            log.close()
        self.logs.clear()

    @staticmethod
    def _tag(rank: int) -> bytes:
        return f"[{rank}] ".encode()

    def _emit(self, fd: int, data: bytes) -> None:
        target = self.targets[fd]
        try:
            target.write(data)
            target.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass  # a closed terminal or `| head` must not stop the job's supervision
