"""Point-to-point messages and the monitored barrier of the jacklring process group: sends on
one thread per peer, receives matched by tag in each peer's Inbox (inbox.py), and gloo's
monitored barrier over those tagged messages (it works while a collective is stuck).
A mixin of JacklringProcessGroup: it uses the group's communicator, executors and checks."""
from __future__ import annotations

import datetime
import time
from typing import Any

import torch

from ..errors import CollectiveTimeout, DistributedError
from . import ops
from .inbox import AnySource, Inbox, PostedRecv
from .torch_errors import torch_flavoured
from .work import JacklringWork

# Reserved tags of monitored_barrier's messages (users' tags are >= 0): the n-th barrier of a
# group uses MONITORED_BARRIER_TAG - n, so a late rank's message of a barrier that timed out can
# never be taken for one of a later barrier.
MONITORED_BARRIER_TAG = -0x4A4C4D42


def _barrier_seconds(opts: Any, default: float) -> float:
    """A monitored barrier's timeout from BarrierOptions, a timedelta or seconds; torch's
    "unset" (negative) means the group's deadline."""
    timeout = getattr(opts, "timeout", opts)
    if timeout is None:
        return default
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return default if seconds < 0 else seconds



class PointToPoint:
    """send, recv, recv_anysource and monitored_barrier of JacklringProcessGroup."""

    _rank: int
    _size: int
    _group_id: str
    _timeout_s: float
    _monitored_barriers: int

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier: every rank reports to rank 0, which waits for each in turn
        until the deadline and raises naming the first rank that did not arrive (every such
        rank with wait_all_ranks), else releases them all. Runs over tagged point-to-point
        messages, so it works while a collective is stuck. opts: a BarrierOptions or a timeout
        (timedelta or seconds); by default the group's deadline.

        A barrier that fails leaves the group usable: its receives that got nothing are
        withdrawn, and each barrier has a tag of its own, so a late rank's message of a failed
        one is dropped when it comes instead of passing (or starving) a later barrier."""
        self._check_open("monitored_barrier")
        seconds = _barrier_seconds(opts, self._timeout_s)
        if self._size == 1:
            return
        self._monitored_barriers += 1
        tag = MONITORED_BARRIER_TAG - self._monitored_barriers
        deadline = time.monotonic() + seconds
        ms = f"{seconds * 1000:.0f} ms"
        token = torch.zeros(1, dtype=torch.uint8)
        if self._rank != 0:
            # gloo's wording for a rank that arrived but was not released: rank 0 names the culprit.
            failure = (f"Rank {self._rank} successfully reached monitoredBarrier, but received errors while waiting "
                       f"for send/recv from rank 0. Please check rank 0 logs for faulty rank")
            self._monitored_step(self.send([token], 0, tag), deadline, f"{failure} (it could not report to rank 0)")
            release = self.recv([torch.zeros(1, dtype=torch.uint8)], 0, tag)
            try:
                self._monitored_step(release, deadline, f"{failure} (not released within {ms}: another rank is "
                                     f"missing or rank 0 is stuck)")
            finally:
                self._withdraw(0, release)
            return
        arrivals = {q: self.recv([torch.zeros(1, dtype=torch.uint8)], q, tag) for q in range(1, self._size)}
        try:
            self._await_arrivals(arrivals, seconds, deadline, wait_all_ranks)
        finally:
            for q, work in arrivals.items():
                self._withdraw(q, work)
        for q in range(1, self._size):
            self._monitored_step(self.send([token], q, tag), deadline,
                                 f"Rank 0 could not release rank {q} in monitoredBarrier")

    def _await_arrivals(self, arrivals: dict[int, JacklringWork], seconds: float, deadline: float,
                        wait_all_ranks: bool) -> None:
        """Rank 0's half of monitored_barrier: raise naming the ranks whose report did not come."""
        ms = f"{seconds * 1000:.0f} ms"
        missing: list[int] = []
        reasons: list[str] = []
        passed: list[int] = []
        for q, work in arrivals.items():
            if wait_all_ranks:  # as gloo: each rank gets the whole timeout, so all late ones are named
                deadline = time.monotonic() + seconds
            elif time.monotonic() >= deadline:  # gloo's wording when rank 0 itself has no time left
                done = ", ".join(str(p) for p in passed) or "none"
                raise torch_flavoured(CollectiveTimeout)(
                    f"rank 0: jacklring monitored_barrier (group {self._group_id or 'default'!r}): Rank 0 timed out "
                    f"in monitoredBarrier after {ms} (no time left to wait for rank {q}; ranks that arrived: {done})")
            try:
                work.wait(max(deadline - time.monotonic(), 1e-3))
                passed.append(q)
            except Exception as exc:
                missing.append(q)
                reasons.append(f"rank {q}: {str(exc).splitlines()[0]}")
                if not wait_all_ranks:
                    break
        if missing:
            who = (f"Rank {missing[0]}" if len(missing) == 1
                   else "Ranks " + ", ".join(str(q) for q in missing))
            raise torch_flavoured(CollectiveTimeout)(
                f"rank 0: jacklring monitored_barrier (group {self._group_id or 'default'!r}): {who} failed to pass "
                f"monitoredBarrier in {ms} (Timed out waiting {ms} for them; {'; '.join(reasons)})")

    def _withdraw(self, src: int, work: JacklringWork) -> None:
        """A monitored barrier's recv from src that it stopped waiting for: taken back, its
        message dropped if it still comes (a no-op once the recv completed)."""
        if not work.is_completed():
            self._inbox(src).abandon(work, f"rank {self._rank}: jacklring monitored_barrier stopped waiting for "
                                           f"rank {src} (the barrier timed out)")

    @staticmethod
    def _monitored_step(work: JacklringWork, deadline: float, failure: str) -> None:
        try:
            work.wait(max(deadline - time.monotonic(), 1e-3))
        except Exception as exc:
            raise torch_flavoured(CollectiveTimeout if isinstance(exc, TimeoutError) else DistributedError)(
                f"{failure}: {str(exc).splitlines()[0]}") from exc

    # ---- point to point ---------------------------------------------------------------------

    def send(self, tensors: Any, dst: int, tag: int = 0) -> JacklringWork:
        tensor = self._single_tensor("send", tensors)
        self._check_peer("send to", dst)
        self._check_open("send")
        what = f"send to rank {dst} (tag {tag})"
        staged = ops.view(tensor)  # copied now: the caller may reuse a non-contiguous source at once

        def run() -> None:
            ops.send_tagged(self._comm, staged.array, dst, tag)
        return self._p2p.get(dst, "send").submit(JacklringWork(what, [tensor]), run)

    def recv(self, tensors: Any, src: int, tag: int = 0) -> JacklringWork:
        tensor = self._single_tensor("recv", tensors)
        self._check_peer("recv from", src)
        self._check_open("recv")
        staged = ops.view(tensor, fill=False)
        work = JacklringWork(f"recv from rank {src} (tag {tag})", [tensor], source_rank=src)
        return self._inbox(src).post(work, tag, staged.array, staged.write_back)

    def _inbox(self, src: int) -> Inbox:
        with self._close_lock:
            inbox = self._inboxes.get(src)
            if inbox is None:
                comm, rank = self._comm, self._rank
                inbox = Inbox(f"jacklring-r{rank}-{self._group_id or 'pg'}-recv-{src}", src,
                              lambda: ops.recv_envelope(comm, src),
                              lambda env, into: ops.recv_payload(comm, src, env, into),
                              lambda env, array, tag: ops.check_envelope(rank, src, env, array, tag),
                              self._completer, self._error)
                self._inboxes[src] = inbox
            return inbox

    @staticmethod
    def _single_tensor(what: str, tensors: Any) -> torch.Tensor:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if len(tensors) != 1:
            raise ValueError(f"jacklring {what}: expected a single tensor, got {len(tensors)} (as gloo)")
        return tensors[0]

    def recv_anysource(self, tensors: Any, tag: int = 0) -> JacklringWork:
        """The first message with `tag` from any peer; work.source_rank() names that peer."""
        tensor = self._single_tensor("recv", tensors)
        self._check_open("recv")
        if self._size == 1:
            raise ValueError(f"jacklring: rank {self._rank} cannot recv from any source in a group of one")
        staged = ops.view(tensor, fill=False)
        work = JacklringWork(f"recv from any source (tag {tag})", [tensor])
        entry = PostedRecv(work, tag, staged.array, staged.write_back, AnySource())
        outcomes = []
        for peer in range(self._size):
            if peer != self._rank:
                outcome = self._inbox(peer).post_any(entry)
                outcomes.append(outcome)
                if outcome == "taken":
                    break
        if outcomes and all(o == "broken" for o in outcomes):
            self._inbox((self._rank + 1) % self._size).finish(
                entry, DistributedError("the connection from every peer failed earlier"))
        return work

    def _check_peer(self, what: str, peer: int) -> None:
        if not 0 <= peer < self._size or peer == self._rank:
            raise ValueError(f"jacklring: rank {self._rank} cannot {what} rank {peer} "
                             f"(group of {self._size})")
