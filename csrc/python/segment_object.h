/* The binding's Segment object (an attached segment), shared by the files of the binding that
 * run collectives on it: engine_module.c (the type and its methods) and shell.c (the fast path). */
#ifndef JL_SEGMENT_OBJECT_H
#define JL_SEGMENT_OBJECT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../shm/engine.h"

typedef struct {
    PyObject_HEAD
    jl_ctx *ctx;               /* NULL once closed */
    PyObject *stall;           /* callable(peer member, header or None) or NULL */
    jl_settings settings;
    /* The header of the fast path's collective in progress (for a stall report), else NULL. */
    const unsigned char *running;
    uint64_t sequence; /* once closed: the count it ended with (jl_sequence while attached) */
} Segment;

/* The Segment type (engine_module.c). */
extern PyTypeObject SegmentType;

/* A failed call's status as the tuple adapter/backends/local/engine.py words: (code, peer,
 * culprit, fd, errno, step, peer_step, header). */
PyObject *jl_status_tuple(const jl_status *st);

#endif
