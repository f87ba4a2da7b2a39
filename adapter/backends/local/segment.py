"""One group's shared-memory segment on this host, run by the native engine (csrc/shm).

Layout: a control block per rank (step counter, "left after an error" word, the headers of its
current collective by step parity) after the sleepers mask and arrival word, then per rank two
data buffers of `chunk_bytes` (even and odd steps). Collectives are sequences of steps; every
step is a full barrier. Waiting spins briefly, checks while yielding the CPU, then sleeps in a
futex on the arrival word; between sleeps it checks the deadline, the peers' "left after an
error" words, their pidfds and the watched sockets (docs/shared-memory.md). All of that is C;
this class holds the segment, the settings, and words the engine's failures as exceptions
(local/engine.py).
"""
from __future__ import annotations

import logging
import os
import sys
import weakref
from typing import Callable

import numpy as np

from ..base import GroupFailure, ReduceOp
from ..elements import BFLOAT16, DTYPE_CODES, check_reducible
from . import engine

log = logging.getLogger("jacklring.shm")

MAX_RANKS = 64                  # ranks per host: one bit per rank in the sleepers mask
CONTROL = 128                   # bytes per control block
HEADER_BYTES = 24
PAGE = 4096

# csrc/shm/engine.h jl_op
OP_CODES = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3, ReduceOp.BAND: 4,
            ReduceOp.BOR: 5, ReduceOp.BXOR: 6}
_BF16_CODE = DTYPE_CODES[BFLOAT16]


def _reducible() -> bytes:
    """By dtype code, a bit per engine op code: the (dtype, op) pairs the library accepts."""
    table = bytearray(16)
    for dtype, code in DTYPE_CODES.items():
        for op, bit in OP_CODES.items():
            try:
                check_reducible(dtype, op)
            except TypeError:
                continue
            table[code] |= 1 << bit
    return bytes(table)


def _fast_dtypes() -> list[tuple[np.dtype, int]]:
    """(dtype, code) for the dtypes the fast path reads by identity: the native numpy ones (both
    names of a 64-bit integer) and bfloat16 (read through numpy's C API, not its buffer protocol)."""
    pairs = list(DTYPE_CODES.items())
    for alias in (np.dtype(np.longlong), np.dtype(np.ulonglong)):
        if all(alias is not dtype for dtype, _ in pairs):
            pairs.append((alias, DTYPE_CODES[alias]))
    return pairs


def _tensor_table() -> tuple | None:
    """What the fast path needs to take plain torch CPU tensors (csrc/python/tensors.c): None
    while torch is not imported (it is never imported here), then (torch.Tensor, (torch dtype,
    engine code) pairs, torch.empty_like, torch.strided). The fast path asks again at each
    call of something that is no numpy array until it has the table."""
    torch = sys.modules.get("torch")
    try:
        tensor, empty_like, strided = torch.Tensor, torch.empty_like, torch.strided  # type: ignore[union-attr]
    except AttributeError:
        return None  # not imported, or still importing
    pairs = []
    for dtype, code in DTYPE_CODES.items():
        named = getattr(torch, str(dtype), None)  # "float32", "bfloat16", ...; older torch lacks uint32
        if named is not None:
            pairs.append((named, code))
    return tensor, pairs, empty_like, strided


def _raw(arr: np.ndarray) -> np.ndarray:
    """What the engine's buffer parser reads: the array itself, or its bytes for bfloat16
    (numpy's buffer protocol does not know ml_dtypes' types)."""
    return arr.view(np.uint8) if arr.dtype == BFLOAT16 else arr


class SharedGroup:
    """One group's segment, step counters, wake-ups and liveness watch."""

    @staticmethod
    def segment_bytes(size: int, chunk_bytes: int) -> int:
        return SharedGroup._data_offset(size) + size * 2 * chunk_bytes

    @staticmethod
    def _data_offset(size: int) -> int:
        return -(-(CONTROL * (size + 1)) // PAGE) * PAGE

    def __init__(self, rank: int, size: int, chunk_bytes: int, segment: int | str,
                 pids: list[int], names: list[int] | None = None,
                 describe: Callable[[bytes], str] = bytes.hex,
                 mismatch: Callable[[int, int, bytes, bytes], str] | None = None) -> None:
        """rank and size count the segment's members; names[q] is member q's rank in the whole
        group (what every message and culprit uses: a host's segment may hold some ranks only)."""
        why = engine.why_missing()
        if why:
            raise RuntimeError(why)
        self.rank, self.size, self.chunk_bytes = rank, size, chunk_bytes
        self.pids = pids
        self._describe = describe
        self._mismatch_text = mismatch
        self.names = list(range(size)) if names is None else list(names)
        self._watched: dict[int, str] = {}
        self.spin_s = 0.0
        self.yield_s = 0.0
        self.stall_report_s: float | None = None
        self.small_bytes = 0
        self.deadline = float("inf")
        self.what: object = "collective"
        fd = segment if isinstance(segment, int) else os.open(segment, os.O_RDWR | os.O_CLOEXEC)
        try:
            self._seg = engine.segment_type()(fd, rank, size, chunk_bytes, self.names, pids, self._settings(),
                                              _stall_reporter(weakref.ref(self)))
        finally:
            if not isinstance(segment, int):
                os.close(fd)
        self._open = True

    # ---- set-up by the owner --------------------------------------------------------------

    def _settings(self) -> tuple:
        stall = int(self.stall_report_s * 1e9) if self.stall_report_s else 0
        return (self.small_bytes, int(self.spin_s * 1e9), int(self.yield_s * 1e9), stall)

    def configure(self, spin_s: float, yield_s: float, stall_report_s: float | None, small_bytes: int) -> None:
        """How waits spin, yield and report stalls, and the largest one-step all_reduce."""
        self.spin_s, self.yield_s, self.stall_report_s, self.small_bytes = spin_s, yield_s, stall_report_s, small_bytes
        self._seg.configure(*self._settings())

    def watch(self, fd: int, label: str, peer: int = -1) -> None:
        """Also wake up and fail when this socket's peer (rank `peer` of the whole group) hangs
        up (a ring link, a JACCL mesh connection). Only for a segment of the whole group: a rank
        on another host may finish a collective and leave while this host's ranks are still at it."""
        self._watched[fd] = label
        self._seg.watch(fd, peer)

    def watched_label(self, fd: int) -> str:
        return self._watched.get(fd, f"fd {fd}")

    def context(self) -> object:
        """The engine's jl_ctx * as a PyCapsule named "jl_ctx" (csrc/shm/engine.h), for C++."""
        return self._seg.context()

    def fast_path(self, lock: object, failure: GroupFailure, failed: Callable[[bytes, float, object], None],
                  timeout: float, magic: int, op_codes: list[int], extras: list[int], layout: int = 0,
                  refuse: bool = False, stage: int = 0) -> object:
        """The engine's fast path over this segment (_engine.Shell, csrc/python/shell.c):
        shell.all_reduce(x, out, OP_CODES[op]), reduce_scatter(x, out, OP_CODES[op]),
        all_gather(x, out), broadcast(x, out, root) and barrier() each run their collective of
        numpy arrays (or plain torch CPU tensors, once torch is imported) in one
        call, taking `lock` (engine.new_lock(): the one its group's other paths take; refuse:
        when it is busy, NotImplemented instead of a wait), refusing when failure.why is set,
        numbering it with this segment's sequence and packing the header in `layout`
        (local/shell.py: the ring's magic, op_codes[collective] in the order all_reduce,
        reduce_scatter, all_gather, broadcast, barrier, dtype code, sequence, byte count,
        extras[engine op] for the reductions, the root plus `stage` for broadcast, `stage` for
        all_gather; or JACCL's); each returns NotImplemented for any call it does not take. A
        failure goes to failed(header, deadline, status or exception), called with the lock
        held, which raises."""
        return engine.shell_type()(self._seg, lock, failure, failed, timeout, magic, op_codes, extras, _reducible(),
                                   _fast_dtypes(), layout, refuse, _tensor_table, stage)

    def raise_status(self, status: tuple, header: bytes | None) -> None:
        """Raise what a failed engine call's status means (local/engine.py's wording)."""
        engine.raise_status(self, status, header)

    @property
    def step(self) -> int:
        return self._seg.step

    @property
    def sequence(self) -> int:
        """The group's collectives so far (the number in every header): kept by the engine
        (jl_sequence), the one count that Python, the engine's fast path and C++ callers share.
        Once closed, the count it ended with."""
        return self._seg.sequence

    @sequence.setter
    def sequence(self, value: int) -> None:
        self._seg.sequence = value

    @property
    def counter(self) -> object:
        """The engine object whose `sequence` attribute is that count (read and advanced in C,
        without a Python frame: local/shell.py counts there)."""
        return self._seg

    # ---- collectives (header: checked against every peer's; None for inner stages) ---------

    def all_reduce(self, header: bytes | None, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        code = DTYPE_CODES[src.dtype]
        if code == _BF16_CODE:  # _raw(), inlined on the hot path
            src, dst = src.view(np.uint8), dst.view(np.uint8)
        status = self._seg.all_reduce(src, dst, code, OP_CODES[op], header, self.deadline)
        if status is not None:
            engine.raise_status(self, status, header)

    def reduce_scatter(self, header: bytes | None, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        status = self._seg.reduce_scatter(_raw(src), _raw(dst), DTYPE_CODES[src.dtype], OP_CODES[op], header,
                                          self.deadline)
        if status is not None:
            engine.raise_status(self, status, header)

    def all_gather(self, header: bytes | None, src: np.ndarray, dst: np.ndarray) -> None:
        status = self._seg.all_gather(_raw(src), _raw(dst), DTYPE_CODES[src.dtype], header, self.deadline)
        if status is not None:
            engine.raise_status(self, status, header)

    def broadcast(self, header: bytes | None, buf: np.ndarray, root: int) -> None:
        status = self._seg.broadcast(_raw(buf), DTYPE_CODES[buf.dtype], root, header, self.deadline)
        if status is not None:
            engine.raise_status(self, status, header)

    def barrier(self, header: bytes | None = None) -> None:
        status = self._seg.barrier(header, self.deadline)
        if status is not None:
            engine.raise_status(self, status, header)

    # ---- failures ---------------------------------------------------------------------------

    def mismatch_text(self, mine: bytes, theirs: bytes, q: int) -> str:
        me, peer = self.names[self.rank], self.names[q]
        if self._mismatch_text is not None:
            return self._mismatch_text(me, peer, mine, theirs)
        return (f"rank {me}: collective mismatch with rank {peer}: this rank called "
                f"{self._describe(mine)} but rank {peer} called {self._describe(theirs)}")

    def _stalled(self, q: int, header: bytes | None) -> None:
        # header: the fast path's collective (which sets no `what`), else None
        what = self.what if header is None else self._describe(header)
        log.warning("rank %d: %s is stalled: waiting for rank %d (pid %d) over shared memory",
                    self.names[self.rank], what, self.names[q], self.pids[q])

    def mark_broken(self, culprit: int = -1) -> None:
        """Tell every peer (waiting or not) that this rank left the group after an error, and
        which rank of the whole group it blames (-1: its own error)."""
        if self._open:
            self._seg.mark_broken(culprit if culprit is not None else -1)

    def close(self) -> None:
        self._open = False
        self._seg.close()


def _stall_reporter(ref: "weakref.ref[SharedGroup]") -> Callable[[int, bytes | None], None]:
    """The engine's stall callback, holding the group weakly (the engine object has no GC
    support, so a strong reference back would keep the segment mapped forever)."""
    def report(q: int, header: bytes | None) -> None:
        group = ref()
        if group is not None:
            group._stalled(q, header)
    return report
