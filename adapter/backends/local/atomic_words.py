"""64-bit atomic words in shared memory, with C11 memory orders, for the shared-memory transport.

The operations come from patomic, the C library that the `atomics` package (PyPI) ships and
binds: each call is a real C11 atomic (`stlr`/`ldar` and `dmb` on ARM, `xchg`/`mov` on x86),
so correctness never rests on x86's store order. The package's public view objects cost several
microseconds per call in Python; its own ctypes binding of the same functions costs about half a
microsecond (ctypes) or 0.2 (cffi), so that is what is used here (pinned to the 1.0 series in pyproject.toml; any import
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
            if not (ops.fp_load and ops.fp_store and ops.binary_ops.fp_fetch_or and ops.binary_ops.fp_fetch_and
                    and ops.unsigned_ops.fp_fetch_add):
                raise RuntimeError("patomic has no lock-free 64-bit load/store/fetch_or/fetch_and/fetch_add here")
            _ops = ops
        except Exception as exc:  # ImportError, a changed layout, an unsupported CPU
            _why_not = f"the atomics package is unusable ({type(exc).__name__}: {exc})"
    return _ops


def available() -> str | None:
    """None when atomic words can be used, else why not."""
    _load_ops()
    return _why_not


class AtomicWords:
    """Atomic access to aligned 8-byte words of a shared mmap, addressed by byte offset.

    The patomic functions are called through cffi function pointers (cffi comes with `atomics`):
    about 200 ns a call from Python, against 350 ns through ctypes."""

    def __init__(self, mem: mmap.mmap) -> None:
        ops = _load_ops()
        if ops is None:
            raise RuntimeError(_why_not)
        import cffi

        ffi = self._ffi = cffi.FFI()

        def pointer(fp, signature: str):
            return ffi.cast(signature, ctypes.cast(fp, ctypes.c_void_p).value)
        self._fp_load = pointer(ops.fp_load, "void(*)(void *, int, void *)")
        self._fp_store = pointer(ops.fp_store, "void(*)(void *, void *, int)")
        self._fp_fetch_or = pointer(ops.binary_ops.fp_fetch_or, "void(*)(void *, void *, int, void *)")
        self._fp_fetch_and = pointer(ops.binary_ops.fp_fetch_and, "void(*)(void *, void *, int, void *)")
        self._fp_fetch_add = pointer(ops.unsigned_ops.fp_fetch_add, "void(*)(void *, void *, int, void *)")
        self._buffer = ffi.from_buffer(mem)  # keeps the mapping exported (and its address valid)
        self._arg = ffi.new("uint64_t *")
        self._res = ffi.new("uint64_t *")
        # Plain (non-atomic) view of the words: hints only, always confirmed by an atomic load.
        self.plain = ffi.cast("uint64_t *", self._buffer)

    def address(self, offset: int):
        """A pointer to the word at this byte offset, for the other methods."""
        if offset % 8:
            raise ValueError(f"atomic word at offset {offset} is not 8-byte aligned")
        return self._buffer + offset

    def load(self, addr, order: int = ACQUIRE) -> int:
        self._fp_load(addr, order, self._res)
        return self._res[0]

    def store(self, addr, value: int, order: int = RELEASE) -> None:
        self._arg[0] = value
        self._fp_store(addr, self._arg, order)

    def fetch_or(self, addr, bits: int, order: int = SEQ_CST) -> int:
        self._arg[0] = bits
        self._fp_fetch_or(addr, self._arg, order, self._res)
        return self._res[0]

    def fetch_and(self, addr, bits: int, order: int = SEQ_CST) -> int:
        self._arg[0] = bits
        self._fp_fetch_and(addr, self._arg, order, self._res)
        return self._res[0]

    def fetch_add(self, addr, value: int, order: int = SEQ_CST) -> int:
        self._arg[0] = value
        self._fp_fetch_add(addr, self._arg, order, self._res)
        return self._res[0]

    def integer_address(self, addr) -> int:
        """The address of a word from address() as an integer (for system calls on it)."""
        return int(self._ffi.cast("uintptr_t", addr))

    def release(self) -> None:
        """Drop the export of the mmap's buffer so the mmap can be closed."""
        buffer, self._buffer = self._buffer, None
        self.plain = None
        if buffer is not None:
            self._ffi.release(buffer)
