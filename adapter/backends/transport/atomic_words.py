"""64-bit atomic words in shared memory, with C11 memory orders, for the shared-memory transport.

The operations come from patomic, the C library that the `atomics` package (PyPI) ships and
binds: each call is a real C11 atomic (`stlr`/`ldar` and `dmb` on ARM, `xchg`/`mov` on x86),
so correctness never rests on x86's store order. The package's public view objects cost several
microseconds per call in Python; its own ctypes binding of the same functions costs about half a
microsecond, so that is what is used here (pinned to the 1.0 series in pyproject.toml; any import
or layout surprise makes `available()` false and the ring falls back to sockets).
"""
from __future__ import annotations

import ctypes
import mmap

RELAXED, ACQUIRE, RELEASE, SEQ_CST = 0, 2, 3, 5

_ops = None
_why_not: str | None = None


def _load_ops():
    global _ops, _why_not
    if _ops is None and _why_not is None:
        try:
            from atomics._impl.patomic import Patomic  # the package's binding of libpatomic
            ops = Patomic.ops(8)
            if not (ops.fp_load and ops.fp_store and ops.binary_ops.fp_fetch_or and ops.binary_ops.fp_fetch_and):
                raise RuntimeError("patomic has no lock-free 64-bit load/store/fetch_or/fetch_and here")
            _ops = ops
        except Exception as exc:  # ImportError, a changed layout, an unsupported CPU
            _why_not = f"the atomics package is unusable ({type(exc).__name__}: {exc})"
    return _ops


def available() -> str | None:
    """None when atomic words can be used, else why not."""
    _load_ops()
    return _why_not


class AtomicWords:
    """Atomic access to aligned 8-byte words of a shared mmap, addressed by byte offset."""

    def __init__(self, mem: mmap.mmap) -> None:
        ops = _load_ops()
        if ops is None:
            raise RuntimeError(_why_not)
        self._anchor = ctypes.c_char.from_buffer(mem)  # keeps the mapping's address valid
        self._base = ctypes.addressof(self._anchor)
        self._fp_load = ops.fp_load
        self._fp_store = ops.fp_store
        self._fp_fetch_or = ops.binary_ops.fp_fetch_or
        self._fp_fetch_and = ops.binary_ops.fp_fetch_and
        self._arg = ctypes.c_uint64(0)
        self._res = ctypes.c_uint64(0)
        self._arg_p = ctypes.addressof(self._arg)
        self._res_p = ctypes.addressof(self._res)

    def address(self, offset: int) -> int:
        if offset % 8:
            raise ValueError(f"atomic word at offset {offset} is not 8-byte aligned")
        return self._base + offset

    def load(self, addr: int, order: int = ACQUIRE) -> int:
        self._fp_load(addr, order, self._res_p)
        return self._res.value

    def store(self, addr: int, value: int, order: int = RELEASE) -> None:
        self._arg.value = value
        self._fp_store(addr, self._arg_p, order)

    def fetch_or(self, addr: int, bits: int, order: int = SEQ_CST) -> int:
        self._arg.value = bits
        self._fp_fetch_or(addr, self._arg_p, order, self._res_p)
        return self._res.value

    def fetch_and(self, addr: int, bits: int, order: int = SEQ_CST) -> int:
        self._arg.value = bits
        self._fp_fetch_and(addr, self._arg_p, order, self._res_p)
        return self._res.value

    def release(self) -> None:
        """Drop the export of the mmap's buffer so the mmap can be closed."""
        self._base = 0
        self._anchor = None
