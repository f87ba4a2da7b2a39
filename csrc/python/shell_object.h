/* The binding's Shell object, a group's fast path, shared by the two files that make it:
 * shell.c (the type, the header, one collective's run) and shell_calls.c (each collective's
 * arguments for numpy arrays; shell_tensors.c for plain torch tensors). */
#ifndef JL_SHELL_OBJECT_H
#define JL_SHELL_OBJECT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "../shm/engine.h"
#include "lock.h"
#include "segment_object.h"
#include "tensors.h"

#define JL_OPS 7
#define JL_DTYPES 16
#define SHELL_RING 0  /* ring/header.py "<HBBIQq": magic, op, dtype, count so far, bytes, extra */
#define SHELL_JACCL 1 /* jaccl/frame_header.py "<BBBBIIiQ": op, reduce, dtype, 0, own number, 0, extra, bytes */

/* The collectives of the fast path, in the order of Shell(op_codes=...). */
enum { SHELL_ALL_REDUCE, SHELL_REDUCE_SCATTER, SHELL_ALL_GATHER, SHELL_BROADCAST, SHELL_BARRIER, SHELL_KINDS };

typedef struct {
    PyObject_HEAD
    Segment *segment;
    Lock *lock;
    PyObject *failure;    /* .why: None while the group is usable */
    PyObject *failed;     /* failed(header, deadline, status tuple or exception): raises */
    double timeout;       /* seconds per collective */
    int layout;           /* SHELL_RING or SHELL_JACCL: the header's layout */
    int refuse;           /* a busy lock: NotImplemented (the Python path refuses), not a wait */
    uint16_t magic;
    uint8_t op_codes[SHELL_KINDS]; /* the header's operation per collective */
    int64_t extra[JL_OPS];         /* the header's extra field (ring) or reduce byte (JACCL) per jl_op */
    int64_t stage;                 /* the ring's: added to the extra field of all_gather and broadcast */
    unsigned char reducible[JL_DTYPES]; /* bit op set: the library accepts (dtype code, op) */
    /* The numpy dtype objects the fast path takes (native byte order; numpy hands out one
     * object per builtin dtype, ml_dtypes one for bfloat16) and their codes: an array's dtype
     * is found by identity. */
    PyObject *dtypes[2 * JL_DTYPES];
    int codes[2 * JL_DTYPES];
    int ndtypes;
    jl_tensors tensors; /* torch's Tensor type and dtypes, once torch is imported */
    unsigned char header[JL_HEADER_BYTES];
} Shell;

/* One collective as the engine runs it. */
typedef struct {
    int kind;         /* SHELL_ALL_REDUCE ... */
    const void *src;  /* broadcast: the buffer (dst too) */
    void *dst;
    size_t count;     /* the engine's count: dst's elements for reduce_scatter, src's otherwise */
    uint64_t nbytes;  /* the header's byte count: src's */
    int dtype;        /* the engine's code; 0 for barrier */
    int op;           /* a jl_op, for the reductions */
    int32_t root;     /* broadcast's */
} shell_call;

/* Runs `call` as the group's next collective: the lock, the "given up" check, the header, the
 * deadline, the engine's call without the GIL. Takes over the references to keep (the inputs,
 * held for the call: an array another thread could resize or free meanwhile; may be NULL) and
 * result (returned on success). NotImplemented when the lock or the group's state leaves the
 * call to the Python path; NULL with the group's exception when the collective failed. */
PyObject *jl_shell_run(Shell *self, const shell_call *call, PyObject *keep, PyObject *result);

#endif
