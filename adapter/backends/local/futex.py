"""Linux futexes on a word of a shared mapping: sleep until the word changes, wake its sleepers.

A shared-memory waiter sleeps in FUTEX_WAIT on the segment's arrival word, and the rank whose
arrival completes a step wakes them all with one FUTEX_WAKE: one system call for any number of
sleepers, where a doorbell per sleeper cost one each. The futexes are shared ones (not
FUTEX_PRIVATE), keyed by the mapping's pages, so only processes that mapped the segment can wake
its waiters. Every wait has a timeout: a waiter also watches deadlines and dead peers.

FUTEX_WAIT compares a 32-bit word; the arrival word is 64 bits, so the wait is on its low half
(at the word's address on a little-endian machine, 4 bytes further on a big-endian one). Where no futex is
known (an unknown architecture) `available()` is False and waiters sleep in short timed naps.
"""
from __future__ import annotations

import ctypes
import os
import sys

FUTEX_WAIT, FUTEX_WAKE = 0, 1
WAKE_ALL = 0x7FFFFFFF
LOW_HALF = 0 if sys.byteorder == "little" else 4  # byte offset of a 64-bit word's low 32 bits

# SYS_futex by machine (the generic table for the newer architectures).
_SYSCALL = {"x86_64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98, "ppc64le": 221, "ppc64": 221,
            "s390x": 238, "loongarch64": 98}


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _bind():
    number = _SYSCALL.get(os.uname().machine) if sys.platform == "linux" else None
    if number is None:
        return None, None
    try:
        libc = ctypes.CDLL(None, use_errno=False)
        call = libc.syscall
    except (OSError, AttributeError):
        return None, None
    call.restype = ctypes.c_long
    call.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                     ctypes.c_void_p, ctypes.c_int]
    return call, number


_call, _number = _bind()


def available() -> bool:
    return _call is not None


class Futex:
    """FUTEX_WAIT / FUTEX_WAKE on the 32-bit word at this address (the low half of a 64-bit word)."""

    def __init__(self, address: int) -> None:
        self.address = address + LOW_HALF
        self._timeout = _Timespec()
        self._timeout_ref = ctypes.byref(self._timeout)

    def wait(self, expected: int, seconds: float) -> None:
        """Sleep while the word still holds expected's low 32 bits, for at most `seconds`. Returns
        on a wake-up, a change of the word (at once), a signal or the timeout: callers re-check."""
        if _call is None:
            import time
            time.sleep(min(seconds, 0.001))
            return
        seconds = max(seconds, 0.0)
        whole = int(seconds)
        self._timeout.tv_sec = whole
        self._timeout.tv_nsec = int((seconds - whole) * 1e9)
        _call(_number, self.address, FUTEX_WAIT, expected & 0xFFFFFFFF, self._timeout_ref, None, 0)

    def wake(self) -> None:
        """Wake every process sleeping on the word."""
        if _call is not None:
            _call(_number, self.address, FUTEX_WAKE, WAKE_ALL, None, None, 0)
