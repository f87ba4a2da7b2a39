"""64-bit atomic words in shared memory, with C11 memory orders, for the shared-memory transport.

The operations come from patomic, the C library that the `atomics` package (PyPI) ships and
binds: each call is a real C11 atomic (`stlr`/`ldar` and `dmb` on ARM, `xchg`/`mov` on x86),
so correctness never rests on x86's store order. The package's public view objects cost several
microseconds per call in Python; its own ctypes binding of the same functions costs about half a
microsecond (ctypes) or 0.2 (cffi), so that is what is used here (pinned to the 1.0 series in pyproject.toml; any import
or layout surprise makes `available()` false and the ring falls back to sockets).

Start-up cost matters too: every rank of a same-host group loads this. `import atomics` runs the
package's __init__, which builds its view classes on cffi's C parser (pycparser: about 0.1 s of
CPU quiet, 0.2-0.3 s on a loaded 2-core machine, per process). The binding needs none of that,
so its module file (ctypes only) is loaded by itself, and the function pointers are typed by
cffi's compiled FFI (`_cffi_backend.FFI`, which parses these simple C types in C): the same
library, the same layout definitions and the same cffi calls as before, without the parser.
"""
from __future__ import annotations

import ctypes
import importlib.util
import mmap
import os
import sys

RELAXED, ACQUIRE, RELEASE, SEQ_CST = 0, 2, 3, 5

_ops = None
_why_not: str | None = None


def _load_ops():
    global _ops, _why_not
    if _ops is None and _why_not is None:
        try:
            ops = _patomic_binding().Patomic.ops(8)
            if not (ops.fp_load and ops.fp_store and ops.binary_ops.fp_fetch_or and ops.binary_ops.fp_fetch_and
                    and ops.unsigned_ops.fp_fetch_add):
                raise RuntimeError("patomic has no lock-free 64-bit load/store/fetch_or/fetch_and/fetch_add here")
            _ops = ops
        except Exception as exc:  # ImportError, a changed layout, an unsupported CPU
            _why_not = f"the atomics package is unusable ({type(exc).__name__}: {exc})"
    return _ops


_BINDING_NAME = "_jacklring_patomic"


def _patomic_binding():
    """atomics/_impl/patomic.py (the package's ctypes binding of libpatomic, which it finds
    beside itself), loaded without running the atomics package's __init__."""
    if _BINDING_NAME in sys.modules:
        return sys.modules[_BINDING_NAME]
    package = importlib.util.find_spec("atomics")  # finds the package without importing it
    if package is None or not package.submodule_search_locations:
        raise ImportError("the atomics package is not installed")
    path = os.path.join(list(package.submodule_search_locations)[0], "_impl", "patomic.py")
    spec = importlib.util.spec_from_file_location(_BINDING_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no patomic binding at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_BINDING_NAME] = module
    return module


def available() -> str | None:
    """None when atomic words can be used, else why not."""
    _load_ops()
    return _why_not


class AtomicWords:
    """Atomic access to aligned 8-byte words of a shared mmap, addressed by byte offset.

    The patomic functions are called through cffi function pointers (cffi comes with `atomics`):
    about 200 ns a call from Python, against 350 ns through ctypes. `_cffi_backend.FFI` is
    cffi's own compiled FFI: the calls are the same, only the type strings are read in C."""

    def __init__(self, mem: mmap.mmap) -> None:
        ops = _load_ops()
        if ops is None:
            raise RuntimeError(_why_not)
        from _cffi_backend import FFI

        ffi = self._ffi = FFI()

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
