"""What every collective of a ring group runs on: its header (checked against the neighbours'),
one collective at a time under a deadline (running()), failure handling (origin.py names the
rank that failed first), scratch memory, and the socket paths, one method per collective with
named parameters (all_reduce, reduce_scatter, all_gather, broadcast, barrier): the one-pass
small path and the reduce-scatter / all-gather / broadcast over every channel (algorithms.py)."""
from __future__ import annotations

import socket
from typing import Callable

import numpy as np

from ... import config
from ...errors import CollectiveTimeout, DistributedError, MismatchError, PeerError, failure_of, with_failure
from ..base import ReduceOp
from ..elements import DTYPE_CODES, byte_view, dtype_code, reduce_many, split_evenly
from ..local.shell import CollectiveShell
from ..protocol import mismatch_message
from ..transport import blame
from . import origin
from .addresses import ranks_on_this_host
from .algorithms import Channel, chain_broadcast, reduce_scatter_all_gather
from .algorithms import all_gather as ring_all_gather
from .formation import FormationAbandoned, LayoutMismatch, layout_told
from .forming import Wording, abandon
from .header import (
    ABORT_MISSING,
    HEADER,
    HEADER_MAGIC,
    OP_ABORT,
    SEQ_MASK,
    describe_header,
    find_abort,
    find_layout_abort,
    header_request,
)
from .state import RingState


class Plumbing:
    """The collective machinery of one group's ring links (state.right, state.left)."""

    def __init__(self, state: RingState, words: Wording) -> None:
        self._state = state
        self._words = words
        # One collective at a time, numbered, with header, deadline and failure, whichever path
        # runs it (the engine's fast path takes the shell's lock and sequence too).
        self._shell = state.shell = CollectiveShell(state.failure, describe_header, self._failed)
        self.small_limit: int = config.get("JACKLRING_RING_SMALL_BYTES")
        # Every rank on this host (the same answer on every rank): bytes are memory copies and
        # hops cost scheduler rounds, not network steps.
        self.on_one_host: bool = ranks_on_this_host(state.addresses, state.rank) == state.size
        one_pass_limit = config.get("JACKLRING_RING_ONE_PASS_BYTES")
        if one_pass_limit is None:
            # Unset: 32 KiB between hosts; on one host the one-pass path (half the hops) wins up
            # to the small limit.
            one_pass_limit = self.small_limit * state.size if self.on_one_host else 32 * 1024
        self._one_pass_limit: int = one_pass_limit
        self._segment_bytes = config.get("JACKLRING_RING_SEGMENT_BYTES")
        self._both_directions = config.get("JACKLRING_RING_DIRECTIONS") == 2
        self._pool: dict[tuple, np.ndarray] = {}
        self._small_view: memoryview | None = None
        # Run when the links close on a failure: the schedules' connections close with them.
        self.on_close: list[Callable[[], None]] = []

    # ---- one collective -----------------------------------------------------------------------

    def header(self, op: int, arr: np.ndarray, extra: int) -> bytes:
        code = DTYPE_CODES.get(arr.dtype) or dtype_code(arr.dtype)
        return HEADER.pack(HEADER_MAGIC, op, code, self._shell.seq & SEQ_MASK, arr.nbytes, extra + self._state.stage)

    def running(self, header: bytes) -> object:
        """`with plumbing.running(header):` runs one collective: serialised, sequence-numbered,
        under the deadline, and fatal to the group on error (the links are closed so the
        neighbours fail fast instead of waiting for the deadline; _failed names the culprit)."""
        return self._shell.running(header, self._state.timeout)

    def collective(self, header: bytes, body: Callable, *args) -> None:
        """body(*args) as one collective (a split's records, the schedules; the socket paths
        below call running() themselves, shared memory runs in the shell's on_segment)."""
        with self._shell.running(header, self._state.timeout):
            body(*args)

    # ---- the socket paths, one collective each ----------------------------------------------

    def all_reduce(self, header: bytes, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        """dst = op over every rank's src: the one pass when it is small, else reduce-scatter +
        all-gather over every channel."""
        with self.running(header):
            if self.one_pass(src.nbytes):
                self.small_all_reduce(header, src, dst, op)
            else:
                self.large(header, src, dst, split_evenly(src.size, self._state.size), op, True)

    def reduce_scatter(self, header: bytes, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        """dst = this rank's block of op over every rank's src."""
        rank, n = self._state.rank, self._state.size
        with self.running(header):
            if self.one_pass(src.nbytes):
                full = self.buffer("rs-small", src.dtype, src.size)
                self.small_all_reduce(header, src, full, op)
                dst[...] = full[rank * dst.size:(rank + 1) * dst.size]
            else:
                self.large(header, src, dst, [(i * dst.size, (i + 1) * dst.size) for i in range(n)], op, False)

    def all_gather(self, header: bytes, src: np.ndarray, dst: np.ndarray) -> None:
        """dst = every rank's src, in rank order."""
        with self.running(header):
            if src.nbytes <= self.small_limit:
                for q, part in enumerate(self.small_gather(header, byte_view(src))):
                    dst[q * src.size:(q + 1) * src.size] = np.frombuffer(part, src.dtype)
            else:
                self.large_gather(header, src, dst)

    def broadcast(self, header: bytes, buf: np.ndarray, root: int) -> None:
        """buf = root's buf, down a chain on every channel."""
        with self.running(header):
            self._broadcast(header, buf, root)

    def barrier(self, header: bytes) -> None:
        """Every rank has reached the barrier (an empty gather)."""
        with self.running(header):
            self.small_gather(header, memoryview(b""))

    def _failed(self, caught: BaseException) -> None:
        """A collective failed with `caught`: give the group up and raise what names the rank at
        fault (returns only when that is `caught` itself, which then propagates as it is)."""
        state = self._state
        exc = caught
        earlier = state.failure.why
        if earlier is not None and isinstance(exc, DistributedError) and not state.abandon_on_failure:
            # Another thread gave the group up while this collective ran (break_links: a
            # shrink, dist.shrink_group's SHRINK_ABORT): say why, not just what broke.
            self.close_links()
            raise PeerError(f"{exc}; {earlier}") from None
        if state.abandon_on_failure:  # a formation's closing barrier: pass the verdict on first
            if isinstance(exc, CollectiveTimeout) and failure_of(exc).culprit is None:
                exc = self._unresponsive_member(exc)
            elif isinstance(exc, PeerError) and not isinstance(exc, FormationAbandoned):
                # A link broke: a neighbour that gave up wrote why before it closed, and
                # what it wrote may still wait unread here; it names the rank at fault.
                exc = self._verdict_on_links() or exc
            abandon(state, self._words, failure_of(exc).suspect(-1), getattr(exc, "missing", False),
                    exc.frame() if isinstance(exc, LayoutMismatch) else None)
        # Name the rank that failed first, not the neighbour that passed the failure on,
        # and tell the other neighbour before the links close (origin.py).
        on_sockets = state.shm is None or origin.from_ring_links(exc)  # a split's records go so
        by_ring = on_sockets and state.hier is None and not state.abandon_on_failure
        named = origin.blame(state, exc) if by_ring else exc
        if isinstance(named, DistributedError) and failure_of(named).sequence is None:
            with_failure(named, operation=str(self._shell.what), sequence=state.seq)  # the record's where
        state.failure.mark(f"{type(named).__name__}: {named}")
        if by_ring and isinstance(named, Exception):
            origin.notify(state, named)
        self.close_links()
        if named is not caught:
            raise named from None

    def _unresponsive_member(self, exc: CollectiveTimeout) -> BaseException:
        """A formation's closing barrier passed its deadline: the members started apart, so the
        one this rank waits for may be live and not at its own deadline yet. Blame the member
        whose listener does not answer a liveness probe (transport/blame.py), the nearest behind
        this rank first (its messages come from the left); exc as it is when all answer."""
        state = self._state
        n, r = state.size, state.rank
        if n <= 2:
            return exc  # the one it waits for is the only one it can be
        silent = blame.first_unresponsive([(r - i) % n for i in range(1, n)],
                                          lambda q: state.addresses[q][0], state.token, r)
        # A member that gave up passed its verdict on before it left (and no longer answers).
        verdict = self._verdict_on_links()
        if verdict is not None:
            return verdict
        if silent is None:
            return exc
        return origin.blaming_text(exc, silent, f"{exc}; {blame.unresponsive_text(self._words.describe_member(silent))}")

    def _verdict_on_links(self) -> BaseException | None:
        """An abort header that arrived on a ring link and was not read yet, as its error."""
        state, words = self._state, self._words
        for link in state.right + state.left:
            try:
                data = link.sock.recv(4096, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except OSError:
                continue
            told = find_layout_abort(data)
            if told is not None:
                return layout_told(f"rank {state.rank}: ", told)
            found = find_abort(data)
            if found is not None:
                reporter, culprit, missing = found
                explain = words.formation_text or words.abort_text
                return words.abandoned(culprit, f"rank {state.rank}: {explain(reporter, culprit, missing)}", missing)
        return None

    def close_links(self) -> None:
        state = self._state
        for link in state.right + state.left:
            link.reset()
            link.close()
        for hook in self.on_close:
            hook()

    def _run(self) -> None:
        shell = self._shell
        self._state.engine.run(shell.deadline, shell.what)  # type: ignore[union-attr]

    def buffer(self, tag: str, dtype: np.dtype, count: int) -> np.ndarray:
        """Reusable scratch memory (allocated once per tag and dtype, grown when needed)."""
        key = (tag, dtype)
        buf = self._pool.get(key)
        if buf is None or buf.size < count:
            buf = np.empty(max(count, 1), dtype)
            self._pool[key] = buf
        return buf[:count]

    def _small_bytes(self, nbytes: int) -> memoryview:
        """A reusable byte buffer for small messages (its memoryview is cached: this is the hot path)."""
        view = self._small_view
        if view is None or len(view) < nbytes:
            view = self._small_view = memoryview(bytearray(max(nbytes, 4096)))
        return view[:nbytes]

    def one_pass(self, nbytes: int) -> bool:
        """Whether a reduction of nbytes takes the one-pass path (each rank sends (n-1) x nbytes
        in n-1 hops) rather than reduce-scatter + all-gather (2(n-1)/n x nbytes in 2(n-1) hops).
        Two ranks send the same either way; more ranks take the one pass only while what it
        sends stays under JACKLRING_RING_ONE_PASS_BYTES, where latency, not bytes, sets the time
        (between hosts; a ring entirely on this host keeps the one pass up to the small limit)."""
        if nbytes > self.small_limit:
            return False
        size = self._state.size
        return size <= 2 or nbytes * (size - 1) <= self._one_pass_limit

    def check_header(self, mine: bytes, raw: memoryview, sender: int) -> None:
        """Raise the error a header from sender that is not `mine` means (scheduled.py's messages)."""
        self._check_header(mine, raw, sender)

    def _check_header(self, mine: bytes, raw: memoryview, sender: int) -> None:
        if raw[:HEADER.size] != mine:
            state, words = self._state, self._words
            theirs = bytes(raw[:HEADER.size])
            magic, op, reason, reporter, _, culprit = HEADER.unpack(theirs)
            if magic == HEADER_MAGIC and op == OP_ABORT:
                told = find_layout_abort(theirs)
                if told is not None:
                    raise layout_told(f"rank {state.rank}: ", told)
                missing = reason == ABORT_MISSING
                explain = words.formation_text or words.abort_text
                raise words.abandoned(culprit, f"rank {state.rank}: {explain(reporter, culprit, missing)}", missing)
            request = header_request(theirs)
            if request is None:
                raise MismatchError(f"rank {state.rank}: rank {sender} sent {describe_header(theirs)} "
                                    f"during {describe_header(mine)}")
            # Headers carry the count of collectives before theirs (packed before collective counts it).
            step = "" if reporter + 1 == state.seq else f" (its operation #{reporter + 1}; this rank's #{state.seq})"
            raise origin.mismatch(state.rank, sender, mismatch_message(state.rank, sender, header_request(mine),
                                                                       request, step))

    # ---- the socket paths ---------------------------------------------------------------------

    def small_gather(self, header: bytes, data: memoryview) -> list[memoryview]:
        """Ring all-gather of header+data messages along the forward direction; each message
        keeps its origin's header, so every rank checks every other rank's request."""
        state = self._state
        n, r = state.size, state.rank
        size = HEADER.size + len(data)
        gathered = self._small_bytes(size * n)
        mine = gathered[r * size:(r + 1) * size]
        mine[:HEADER.size] = header
        mine[HEADER.size:] = data
        out, inp = state.right[0], state.left[0]
        out.post_send(mine)
        for step in range(n - 1):
            q = (r - step - 1) % n
            view = gathered[q * size:(q + 1) * size]

            def done(view=view, q=q, forward=step < n - 2) -> None:
                self._check_header(header, view, q)
                if forward:
                    out.post_forward(view, inp)

            def truncated(got: int, view=view, q=q) -> None:
                if got >= HEADER.size:
                    self._check_header(header, view, q)
            inp.post_recv(view, done, truncated)
        self._run()
        return [gathered[q * size + HEADER.size:(q + 1) * size] for q in range(n)]

    def small_all_reduce(self, header: bytes, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        parts = self.small_gather(header, byte_view(src))
        reduce_many(dst, [np.frombuffer(p, src.dtype) for p in parts], op)

    def _channels(self) -> list[Channel]:
        state = self._state
        n, r = state.size, state.rank
        forward = [Channel(out, inp, r) for out, inp in zip(state.right, state.left)]
        if not self._both_directions:
            return forward
        backward = [Channel(out, inp, n - 1 - r) for out, inp in zip(state.left, state.right)]
        return forward + backward

    @staticmethod
    def _rank_at(ch_index: int, n_forward: int, n: int, pos: int) -> int:
        return pos if ch_index < n_forward else n - 1 - pos

    def _exchange_headers(self, header: bytes) -> None:
        """Each link carries this rank's header out and the neighbour's header in."""
        state = self._state
        for link in state.right + state.left:
            link.post_send(memoryview(header))
            raw = bytearray(HEADER.size)
            link.post_recv(memoryview(raw), lambda raw=raw, peer=link.peer: self._check_header(header, memoryview(raw), peer))

    def large(self, header: bytes, src: np.ndarray, dst: np.ndarray, blocks: list[tuple[int, int]],
              op: ReduceOp, gather: bool) -> None:
        """Reduce-scatter (+ all-gather when gather) over every channel. blocks[i] is rank i's
        block of src; without gather, dst is this rank's block only."""
        state = self._state
        n = state.size
        channels = self._channels()
        n_forward = len(state.right)
        seg = max(1, self._segment_bytes // src.itemsize)
        work = dst if gather else self.buffer("rs-work", src.dtype, src.size)
        self._exchange_headers(header)
        for ci, ch in enumerate(channels):
            s_chunks, a_chunks = [], []
            for pos in range(n):
                owner = self._rank_at(ci, n_forward, n, pos)
                lo, hi = blocks[owner]
                plo, phi = split_evenly(hi - lo, len(channels))[ci]
                s_chunks.append(src[lo + plo:lo + phi])
                if not gather and owner == state.rank:
                    a_chunks.append(dst[plo:phi])
                else:
                    a_chunks.append(work[lo + plo:lo + phi])
            scratch = self.buffer(f"scratch{ci}", src.dtype, seg)
            reduce_scatter_all_gather(ch, n, s_chunks, a_chunks, a_chunks if gather else None, op, scratch, seg)
        self._run()

    def large_gather(self, header: bytes, src: np.ndarray, dst: np.ndarray) -> None:
        state = self._state
        n, m = state.size, src.size
        channels = self._channels()
        n_forward = len(state.right)
        seg = max(1, self._segment_bytes // src.itemsize)
        dst[state.rank * m:(state.rank + 1) * m] = src
        self._exchange_headers(header)
        for ci, ch in enumerate(channels):
            plo, phi = split_evenly(m, len(channels))[ci]
            chunks = []
            for pos in range(n):
                owner = self._rank_at(ci, n_forward, n, pos)
                chunks.append(dst[owner * m + plo:owner * m + phi])
            ring_all_gather(ch, n, chunks, seg)
        self._run()

    def _broadcast(self, header: bytes, buf: np.ndarray, root: int) -> None:
        state = self._state
        n = state.size
        channels = self._channels()
        n_forward = len(state.right)
        seg = max(1, self._segment_bytes // max(1, buf.itemsize))
        self._exchange_headers(header)
        for ci, ch in enumerate(channels):
            plo, phi = split_evenly(buf.size, len(channels))[ci]
            root_pos = root if ci < n_forward else n - 1 - root
            chain_broadcast(ch, n, root_pos, buf[plo:phi], seg)
        self._run()
