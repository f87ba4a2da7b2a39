"""Run a set of ranks to completion: pump output and stdin, and stop everything as soon
as one rank fails (with `restart_failed`: once the replacements are used up; with `min_ranks`:
as soon as fewer than that many are left) or the launcher is interrupted. Returns the
launcher's exit code."""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from typing import Callable, Optional

from .output import OutputRouter
from .ranks import RankProcess, StartError

GRACE = 3.0       # SIGTERM -> SIGKILL
GIVE_UP = 4.0     # after SIGKILL, how long to wait for ranks (e.g. a dead ssh link) to report
TICK = 0.05
OUTPUT_BACKLOG = 256  # chunks (<= 64 KiB each) per stream read from ranks but not yet written out
OUTPUT_PATIENCE = 1.0  # after an interruption, how long output may make no progress
DISMISS_AFTER = 2.0   # once only replacements are left and the others finished, until they are stopped


def _say(message: str) -> None:
    """One launcher line on stderr, in one write: the writer threads put the ranks' lines on the
    same fd, and print() writes the newline apart, so a rank's line could land between the two
    ("...(1 of 1 used)[1] launcher: rank process ... was killed" on one line)."""
    sys.stderr.write(f"launcher: {message}\n")
    sys.stderr.flush()


class EventSink:
    """What ranks report into. Output goes to the writer thread through a bounded backlog
    per stream, everything else (exits) to the control loop, so a slow terminal (`| less`)
    delays neither a failure's stop nor Ctrl-C, a stalled stdout does not hold back stderr,
    and a fast rank cannot fill our memory: when a stream's backlog is full its reader waits
    and the rank's own writes block, as without us. A chunk's slot is freed once its bytes
    are written out (FdWriter.after)."""

    def __init__(self) -> None:
        self.control: queue.Queue = queue.Queue()
        self.output: queue.Queue = queue.Queue()
        self.slots = {1: threading.BoundedSemaphore(OUTPUT_BACKLOG),
                      2: threading.BoundedSemaphore(OUTPUT_BACKLOG)}

    def put(self, event: tuple) -> None:
        if event[0] == "output":
            self.slots[event[2]].acquire()
            self.output.put(event)
        else:
            self.control.put(event)

    def after_output(self, event: tuple) -> None:
        """Ordered behind output already queued (e.g. a rank's end after its last line)."""
        self.output.put(event)


def _write_output(sink: EventSink, output: OutputRouter) -> None:
    """The router thread: the only one that touches `output`. The writes themselves happen
    on its FdWriters, so it never waits on a reader. It never dies of an error in the output
    path: a dead router would leave every rank blocked on a full pipe."""
    writers = output.writers
    while True:
        try:
            event = sink.output.get(timeout=TICK)
        except queue.Empty:
            event = None
        kind = event[0] if event else None
        try:
            if kind == "output":
                output.write(*event[1:])
            elif kind == "end":
                output.end_rank(event[1])
            elif kind == "echoed":
                output.input_echoed()
            elif kind == "close":
                output.close()
            output.flush_partials()
        except Exception as e:  # a bug here must cost output, not the job
            output.failures.append(f"output error: {type(e).__name__}: {e}")
        if kind == "output":
            writers[event[2]].after(sink.slots[event[2]].release)
        for message in output.take_failures():
            sink.control.put(("log-failed", message))
        if kind == "close":
            for writer in set(writers.values()):
                writer.close()
            return


def _stdin_reader(events: queue.Queue) -> None:
    while True:
        try:
            data = os.read(0, 65536)
        except OSError:
            data = b""
        events.put(("stdin", data))
        if not data:
            return


def _is_terminal(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _can_read_stdin() -> bool:
    try:
        os.fstat(0)
    except OSError:
        return False
    # Reading a terminal from a background job would stop the launcher (SIGTTIN).
    if os.isatty(0):
        try:
            return os.tcgetpgrp(0) == os.getpgrp()
        except OSError:
            return False
    return True


def describe_exit(code: int, signum: Optional[int]) -> str:
    """`was killed by SIGSEGV (exit code 139)`; a remote rank's agent can only pass on
    the 128 + N code, so there the signal is named as what the code stands for."""
    if signum is not None:
        return f"was killed by {_signal_name(signum)} (exit code {code})"
    if 128 < code < 128 + 65:
        return f"exited with code {code} (128 + {code - 128}: killed by {_signal_name(code - 128)})"
    return f"exited with code {code}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Supervisor:
    def __init__(self, ranks: list[RankProcess], output: OutputRouter,
                 grace: float = GRACE, log=None, stop_on_log_error: bool = False,
                 min_ranks: Optional[int] = None, restart_failed: int = 0,
                 replacement: Optional[Callable[[RankProcess, int], RankProcess]] = None) -> None:
        self.ranks = ranks
        # Replacements: a failed rank is started again (replacement(failed, new index) builds the
        # process, with the environment that makes it join the survivors) at most this often.
        self.restart_failed = restart_failed if replacement is not None else 0
        self.replacement = replacement
        self.replaced: list[RankProcess] = []   # the processes that were replaced
        self.newcomers: set[int] = set()        # indices of the replacements started
        self.finished: set[int] = set()         # indices of the processes that ended with 0
        # Replacements that no grow() took in before every other rank ended with 0 (stopped by
        # us), and failed ranks not replaced because others had already finished: the job's work
        # was done without them, so they do not fail it.
        self.unneeded: list[tuple[RankProcess, str]] = []
        self.dismissed: set[int] = set()
        self.dismiss_at: Optional[tuple[float, int]] = None  # (when, signal) for the dismissed
        # Elastic jobs: a rank that fails is let go while at least min_ranks are not lost.
        self.min_ranks = min_ranks
        self.lost: list[RankProcess] = []
        self.stop_on_log_error = stop_on_log_error
        self.output = output
        self.grace = grace
        self.log = log or _say
        self.sink = EventSink()
        self.events = self.sink.control
        self.pending_signal: Optional[int] = None
        self.running: set[int] = set()   # processes not yet ended
        self.draining: set[int] = set()  # ranks whose output is not all read yet
        self.late_log_failures: list[str] = []

    def _on_signal(self, signum, frame) -> None:
        # Only a flag: queue.put from a signal handler could deadlock with the main loop.
        self.pending_signal = signum

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal)
                    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            return self._run()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _run(self) -> int:
        failure: Optional[tuple[RankProcess, int, str, int]] = None
        first_end: Optional[tuple[RankProcess, str, int]] = None  # before any stop of ours
        log_error: Optional[str] = None
        interrupted: Optional[int] = None
        self.output.use_writers()
        writer = threading.Thread(target=_write_output, args=(self.sink, self.output),
                                  daemon=True)
        writer.start()
        for proc in self.ranks:
            if self.pending_signal is not None:
                break
            try:
                proc.start(self.sink)
            except StartError as e:
                failure = (proc, 255, f"could not start: {e}", len(self.running))
                break
            self.running.add(proc.index)
            self.draining.add(proc.index)
        if _can_read_stdin():
            threading.Thread(target=_stdin_reader, args=(self.events,), daemon=True).start()

        stop_at = kill_at = give_up_at = None
        if failure is not None:
            stop_at = self._stop(signal.SIGTERM)
        while self.running:
            now = time.monotonic()
            if self.pending_signal is not None:
                signum, self.pending_signal = self.pending_signal, None
                if stop_at is None:
                    interrupted = signum
                    stop_at = self._stop(signum)
                elif kill_at is None:  # a second Ctrl-C: no more patience
                    kill_at = now
            if stop_at is not None and kill_at is None and now >= stop_at:
                kill_at = now
            if kill_at is not None and give_up_at is None and now >= kill_at:
                for proc in self._running_procs():
                    proc.kill()
                give_up_at = now + GIVE_UP
            if give_up_at is not None and now >= give_up_at:
                break
            if self.dismiss_at is not None and now >= self.dismiss_at[0]:
                sig = self.dismiss_at[1]
                for proc in self._running_procs():
                    if proc.index not in self.dismissed:
                        continue
                    if sig == signal.SIGTERM:
                        self.log(f"every other rank ended with exit code 0 {DISMISS_AFTER:g} s ago while the "
                                 f"replacement {proc.describe()} still runs: no grow() will take it in; stopping it")
                        self.unneeded.append((proc, f"the replacement {proc.describe()} was not taken in before "
                                                    f"the other ranks finished, and was stopped"))
                        proc.signal(sig)
                    else:
                        proc.kill()
                self.dismiss_at = (now + self.grace, signal.SIGKILL) if sig == signal.SIGTERM else None
            try:
                event = self.events.get(timeout=TICK)
            except queue.Empty:
                continue
            kind = event[0]
            if kind == "stdin":
                self._broadcast_stdin(event[1])
            elif kind == "log-failed":
                self.log(event[1])
                if self.stop_on_log_error and stop_at is None:
                    log_error = event[1]
                    stop_at = self._stop(signal.SIGTERM)
            elif kind == "exit":
                _, index, code, signum = event
                self.running.discard(index)
                if index in self.dismissed:
                    if code == 0:  # it ended with the group after all: it had been taken in
                        self.finished.add(index)
                    continue  # a replacement nobody took in, stopped by us: not a failure
                if code == 0:
                    self.finished.add(index)
                    if stop_at is None:
                        self._dismiss_newcomers()
                if first_end is None and stop_at is None:
                    first_end = (self.ranks[index], describe_exit(code, signum), len(self.running))
                if code != 0 and failure is None and stop_at is None:
                    if self._replace(self.ranks[index], describe_exit(code, signum)):
                        continue
                    if self._let_go(self.ranks[index], describe_exit(code, signum)):
                        continue
                    failure = (self.ranks[index], code, describe_exit(code, signum),
                               len(self.running))
                    stop_at = self._stop(signal.SIGTERM)
            elif kind == "drained":
                self._drained(event[1])

        for proc in self.ranks:
            proc.cleanup()
        self._finish_output(writer, interrupted is not None)
        late = self._late_log_failures()  # while writing the ranks' last output
        if late and self.stop_on_log_error and log_error is None:
            log_error = late[0]
        if log_error is not None and failure is None and interrupted is None:
            if stop_at is not None:
                self.log(f"stopped all {len(self.ranks) - len(self.replaced)} ranks: a --log-dir file could not be written "
                         f"(--log-errors stop)")
            else:
                self.log("a --log-dir file could not be written (--log-errors stop); the ranks had already ended")
            return 1
        if failure is not None and first_end is not None and first_end[0] is not failure[0]:
            # The failure is often a consequence (a peer raised because this rank was gone).
            proc, how, left = first_end
            self.log(f"{proc.describe()} ended first: it {how} while {left} other "
                     f"rank{'s were' if left != 1 else ' was'} still running")
        return self._summarize(failure, interrupted)

    def _replace(self, proc: RankProcess, how: str) -> bool:
        """With restart_failed left: start a replacement for `proc` and say so; True if it started."""
        if len(self.replaced) >= self.restart_failed or self.pending_signal is not None:
            return False
        if self.finished and not self.unneeded:
            # The others are ending: no grow() will take a replacement in, and one that waits
            # for it would fail the job a connect deadline later.
            done = ", ".join(str(self.ranks[i].rank) for i in sorted(self.finished))
            self.log(f"{proc.describe()} {how}; not replaced: rank{'s' if len(self.finished) > 1 else ''} {done} "
                     f"had already finished (exit code 0), so no grow() would take a replacement in")
            self.unneeded.append((proc, f"{proc.describe()} {how} after rank{'s' if len(self.finished) > 1 else ''} "
                                        f"{done} had finished: not replaced"))
            self._dismiss_newcomers()
            return True
        if self.unneeded:
            return False  # a second failure while the job ends: a failure, as without the option
        new = self.replacement(proc, len(self.ranks))
        self.replaced.append(proc)
        self.log(f"{proc.describe()} {how}; starting a replacement (--restart-failed: "
                 f"{len(self.replaced)} of {self.restart_failed} used)")
        try:
            new.start(self.sink)
        except StartError as e:
            self.log(f"the replacement for rank {proc.rank} could not start: {e}")
            return False
        self.ranks.append(new)
        self.running.add(new.index)
        self.draining.add(new.index)
        self.newcomers.add(new.index)
        return True

    def _dismiss_newcomers(self) -> None:
        """Once every rank still running is a replacement and another rank has finished with
        0, the group has ended without taking those replacements in (a replacement that was
        taken in ends with the group): stop them, and do not count their ends as failures."""
        left = self.running - self.dismissed
        if not left or not self.finished or not left <= self.newcomers:
            return
        self.dismissed |= left
        # A replacement that was taken in ends with the group, in a moment: it is not cut short.
        self.dismiss_at = (time.monotonic() + DISMISS_AFTER, signal.SIGTERM)

    def _let_go(self, proc: RankProcess, how: str) -> bool:
        """With min_ranks: count `proc` as lost and say so; True while enough ranks are left
        (running, or ended with 0) for the job to go on without it."""
        if self.min_ranks is None:
            return False
        self.lost.append(proc)
        size = len(self.ranks) - len(self.replaced)
        left = size - len(self.lost)
        if left >= self.min_ranks:
            self.log(f"lost {proc.describe()}: it {how}; {left} of {size} ranks go on "
                     f"(--min-ranks {self.min_ranks})")
            return True
        self.log(f"lost {proc.describe()}: it {how}; {left} of {size} ranks left, "
                 f"fewer than --min-ranks {self.min_ranks}: stopping the job")
        return False

    def _late_log_failures(self) -> list[str]:
        """Log failures the writer reported after the control loop ended: said here, once."""
        late, self.late_log_failures = self.late_log_failures, []
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return late
            if event[0] == "log-failed":
                self.log(event[1])
                late.append(event[1])

    def _running_procs(self) -> list[RankProcess]:
        return [p for p in self.ranks if p.index in self.running]

    def _stop(self, sig: int) -> float:
        for proc in self._running_procs():
            proc.signal(sig)
        return time.monotonic() + self.grace

    def _broadcast_stdin(self, data: bytes) -> None:
        if b"\n" in data and _is_terminal(0):
            # Ahead of the ranks' answer: the terminal's echo of this line ended the line a
            # prompt left open, so the answer needs its own prefix.
            self.sink.after_output(("echoed",))
        for proc in self._running_procs():
            if data:
                proc.send_stdin(data)
            else:
                proc.close_stdin()

    def _drained(self, index: int) -> None:
        """All of a rank's output is read: its unfinished lines can be closed after it."""
        self.draining.discard(index)
        self.sink.after_output(("end", self.ranks[index].rank))

    def _finish_output(self, router: threading.Thread, interrupted: bool) -> None:
        """Let the writers show what the ranks printed, however long a slow reader takes. A
        reader that never reads on (a paused pager) could hold us here forever: a signal gives
        up on the rest at once, and after an interruption so does a second without progress.
        What is given up is said once."""
        writers = set(self.output.writers.values())
        closed, progress, idle_since = False, -1, time.monotonic()
        while True:
            if not closed and not (self.draining - self.running):  # ranks given up on: not awaited
                self.sink.after_output(("close",))
                closed = True
            if closed and not router.is_alive() and all(w.join(0) for w in writers):
                return
            now = time.monotonic()
            done = sum(w.written for w in writers) + sum(p.delivered for p in self.ranks)
            if done != progress:
                progress, idle_since = done, now
            elif interrupted and now - idle_since > OUTPUT_PATIENCE:
                break
            if self.pending_signal is not None:
                break
            try:
                event = self.events.get(timeout=TICK)
            except queue.Empty:
                continue
            if event[0] == "drained":
                self._drained(event[1])
            elif event[0] == "log-failed":
                self.log(event[1])
                self.late_log_failures.append(event[1])
        left = {w.fd: w.queued for w in writers if w.queued}
        where = " and ".join(f"{n} bytes for {'stdout' if fd == self.output.targets[1] else 'stderr'}"
                             for fd, n in left.items())
        self.log(f"gave up on the ranks' output not yet written ({where or 'what was still being read'}): "
                 f"nothing read it")

    def _summarize(self, failure, interrupted: Optional[int]) -> int:
        unresponsive = [p.describe() for p in self._running_procs()]
        if unresponsive:
            self.log(f"gave up waiting for {', '.join(unresponsive)}")
        if failure is not None:
            proc, code, what, others = failure  # others: ranks still running then
            tail = f"; stopped the other {others} rank{'s' if others != 1 else ''}" if others else ""
            self.log(f"{proc.describe()} {what}{tail}")
            return code if 0 < code < 256 else 1
        if interrupted is not None:
            name = signal.Signals(interrupted).name
            self.log(f"interrupted by {name}; stopped all {len(self.ranks) - len(self.replaced)} ranks")
            return 128 + interrupted
        size = len(self.ranks) - len(self.replaced)  # the job's ranks, each counted once
        if self.unneeded:
            ended = len(self.finished)
            self.log(f"finished with {ended} of {size} ranks (--restart-failed {self.restart_failed}): "
                     + "; ".join(what for _, what in self.unneeded)
                     + f"; the other {ended} had done the job's work (exit code 0)")
            return 0
        if self.replaced:
            names = ", ".join(str(p.rank) for p in self.replaced)
            self.log(f"finished with {size - len(self.lost)} of {size} ranks after {len(self.replaced)} "
                     f"replacement{'s' if len(self.replaced) > 1 else ''} (--restart-failed "
                     f"{self.restart_failed}); replaced rank{'s' if len(self.replaced) > 1 else ''} {names}")
        if self.lost:
            names = ", ".join(str(p.rank) for p in self.lost)
            self.log(f"finished with {size - len(self.lost)} of {size} ranks "
                     f"(--min-ranks {self.min_ranks}); lost rank{'s' if len(self.lost) > 1 else ''} {names}")
        return 0
