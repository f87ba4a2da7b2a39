"""How a backend uses shared memory: attach() forms the segment under the JACKLRING_* settings
that every backend reads alike; broken() marks the group broken after an error so that waiting
peers fail at once (local/shell.py runs each collective).

JACKLRING_LOCAL_TRANSPORT chooses: auto and shm use shared memory between the ranks of a host
(shm also logs a warning when they cannot); unix and tcp never do. Ranks that disagree fall back
to their backend's sockets together, since the decision is collective.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

from ... import config
from ...errors import failure_of
from . import engine, shm
from .segment import PAGE, SharedGroup

log = logging.getLogger("jacklring.shm")

SPIN_US = 1.0               # pause-instruction spin before yielding, unless JACKLRING_SPIN_US
SPINNING_RANKS_PER_CPU = 2  # beyond this many ranks of the segment per CPU, no spin (spin_us below)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def spin_us(local_ranks: int) -> float:
    """How long a shared-memory waiter spins before it yields: JACKLRING_SPIN_US when set, else
    SPIN_US, or 0 with more than SPINNING_RANKS_PER_CPU ranks of the segment per CPU this process
    may run on: the peer it waits for is then mostly waiting for this very CPU (at two ranks per
    CPU the spin still pays off for large messages; docs/shared-memory.md, "Waiting")."""
    value = config.get("JACKLRING_SPIN_US")
    if value is not None:
        return value
    return SPIN_US if local_ranks <= SPINNING_RANKS_PER_CPU * _cpus() else 0.0


def attach(rank: int, size: int, gather: Callable[[bytes], list[bytes]], describe: Callable[[bytes], str],
           mismatch: Callable[[int, int, bytes, bytes], str] | None = None) -> shm.Placement:
    """Find which ranks share a host and give each such host a segment (a collective: gather
    exchanges shm.RECORD_BYTES-byte records among all ranks). placement.shared is False, with no
    segment anywhere, when the group uses its sockets only."""
    mode = config.get("JACKLRING_LOCAL_TRANSPORT")
    chunk = -(-config.get("JACKLRING_SHM_CHUNK_BYTES") // PAGE) * PAGE
    placement = shm.form(rank, size, gather, chunk, wanted=mode in ("auto", "shm"), describe=describe,
                         mismatch=mismatch)
    if not placement.shared:
        if mode == "shm":
            log.warning("rank %d: JACKLRING_LOCAL_TRANSPORT=shm but the group cannot share memory; "
                        "using sockets", rank)
        return placement
    group = placement.group
    if group is not None:
        # A microsecond of pause instructions catches a peer that is running right now; then
        # checking while yielding the CPU (a system call per check, well under a microsecond) never
        # keeps a peer that waits for this CPU off it; pure busy-spinning measured several times
        # slower on a loaded host, so longer spins are off unless asked for.
        group.configure(spin_s=spin_us(group.size) * 1e-6, yield_s=config.get("JACKLRING_SHM_YIELD_US") * 1e-6,
                        stall_report_s=config.get("JACKLRING_STALL_REPORT"),
                        small_bytes=config.get("JACKLRING_SHM_SMALL_BYTES"))
    return placement


def new_lock() -> object:
    """The lock a group's collectives take (one at a time), shared with the engine's fast path."""
    return engine.new_lock()


def is_engine_lock(lock: object) -> bool:
    """Whether the engine's fast path can take this lock (one new_lock() made with the engine)."""
    return engine.is_engine_lock(lock)


def broken(group: SharedGroup, exc: BaseException) -> None:
    """A collective over `group` failed with exc: tell the peers at once whom to blame
    (local/shell.py's error path)."""
    culprit = failure_of(exc).culprit
    group.mark_broken(-1 if culprit is None else culprit)  # whom the peers should blame
