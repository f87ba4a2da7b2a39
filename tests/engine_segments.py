"""Several members of one segment in one process, one thread each: the engine's collectives
run for real (one memfd, real steps and futex waits, the GIL released around each call) without
starting processes."""
from __future__ import annotations

import os
import threading
from typing import Callable

from adapter.backends.local.segment import SharedGroup

CHUNK = 64 * 1024


def attach(size: int, chunk: int = CHUNK, small: int = 16 * 1024) -> list[SharedGroup]:
    fd = os.memfd_create("jacklring-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, SharedGroup.segment_bytes(size, chunk))
        groups = [SharedGroup(q, size, chunk, fd, [os.getpid()] * size) for q in range(size)]
    finally:
        os.close(fd)
    for g in groups:
        g.configure(spin_s=1e-6, yield_s=0.0, stall_report_s=None, small_bytes=small)
        g.deadline = float("inf")
    return groups


def together(groups: list[SharedGroup], call: Callable[[SharedGroup], object], timeout: float = 30.0) -> list:
    """call(group) on every member at once; the results (or exceptions) by member."""
    results: list = [None] * len(groups)

    def one(q: int) -> None:
        try:
            results[q] = call(groups[q])
        except BaseException as exc:  # handed back to the test
            results[q] = exc
    threads = [threading.Thread(target=one, args=(q,)) for q in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a member did not finish within the timeout"
    return results
