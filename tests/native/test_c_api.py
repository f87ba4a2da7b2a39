"""What a C or C++ extension reaches at run time (csrc/shm/engine.h): the module's API capsule
holds the versioned function table, a segment's context() capsule its jl_ctx *, and the table's
functions run on that context without Python (called here through ctypes, as C would)."""
from __future__ import annotations

import ctypes

import numpy as np
from engine_segments import attach, together

from adapter.backends.local import _engine

ABI_VERSION = 2
CTX = ctypes.c_void_p
STATUS = ctypes.c_byte * 64  # jl_status is 56 bytes; room to spare
ALL_REDUCE = ctypes.CFUNCTYPE(ctypes.c_int, CTX, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                              ctypes.c_int, ctypes.c_char_p, ctypes.c_int64, ctypes.POINTER(STATUS))


class Api(ctypes.Structure):
    _fields_ = [("abi_version", ctypes.c_uint32), ("struct_size", ctypes.c_uint32),
                ("all_reduce", ALL_REDUCE), ("reduce_scatter", ctypes.c_void_p), ("all_gather", ctypes.c_void_p),
                ("broadcast", ctypes.c_void_p), ("barrier", ctypes.c_void_p), ("mark_broken", ctypes.c_void_p),
                ("member", ctypes.CFUNCTYPE(ctypes.c_int32, CTX)), ("size", ctypes.CFUNCTYPE(ctypes.c_int32, CTX)),
                ("step", ctypes.CFUNCTYPE(ctypes.c_uint64, CTX)), ("dtype_size", ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_int)),
                ("sequence", ctypes.CFUNCTYPE(ctypes.c_uint64, CTX)),
                ("set_sequence", ctypes.CFUNCTYPE(None, CTX, ctypes.c_uint64)),
                ("next_sequence", ctypes.CFUNCTYPE(ctypes.c_uint64, CTX))]


def capsule_pointer(capsule: object, name: bytes) -> int:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return get(capsule, name)


def test_the_table_runs_a_collective_on_a_segments_context():
    api = Api.from_address(capsule_pointer(_engine.API, b"adapter.backends.local._engine.API"))
    assert api.abi_version == ABI_VERSION and api.struct_size >= ctypes.sizeof(Api)
    assert api.dtype_size(12) == 4 and api.dtype_size(99) == 0
    groups = attach(2)
    try:
        contexts = [capsule_pointer(g.context(), b"jl_ctx") for g in groups]
        assert [api.member(c) for c in contexts] == [0, 1] and api.size(contexts[0]) == 2
        xs = [np.arange(5, dtype=np.float32) * (q + 1) for q in range(2)]
        statuses = [STATUS() for _ in range(2)]

        def call(g):
            x = xs[g.rank]
            # ctypes releases the GIL around a foreign call, so both members run at once.
            return api.all_reduce(contexts[g.rank], x.ctypes.data, x.ctypes.data, x.size, 12, 0, None,
                                  2**63 - 1, ctypes.byref(statuses[g.rank]))
        assert together(groups, call) == [0, 0]
        for x in xs:
            assert x.tolist() == (np.arange(5) * 3).tolist()
        assert api.step(contexts[0]) == 1
        # One sequence count per segment, shared with the Python side (Segment.sequence).
        assert api.sequence(contexts[0]) == 0
        assert api.next_sequence(contexts[0]) == 0 and api.next_sequence(contexts[0]) == 1
        assert groups[0].sequence == 2
        groups[0].sequence = 41
        assert api.sequence(contexts[0]) == 41
        api.set_sequence(contexts[0], 7)
        assert groups[0].sequence == 7 and groups[1].sequence == 0
    finally:
        for g in groups:
            g.close()
