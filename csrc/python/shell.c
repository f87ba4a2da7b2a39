/* The binding's fast path: one C call from adapter.ops to the engine's collective.
 *
 * Shell: what a group's Python shell (adapter/backends/local/shell.py) does around a collective
 * over its segment (the lock, the "given up" check, the sequence number, the header in the ring's
 * or JACCL's layout, the deadline), for the common cases only (shell_calls.c and shell_tensors.c
 * say which: numpy arrays, C-contiguous and aligned, of a dtype of the group's table, and plain
 * torch CPU tensors). Anything else returns NotImplemented before anything happened, and the caller
 * runs its Python path, which words every refusal as it always did. A failed collective goes to
 * the group's Python failure handler (failed(header, deadline, status tuple or exception),
 * called with the lock held; it raises), so every exception and message is the Python path's. */
#include "shell.h"

#include <math.h>
#include <string.h>
#include <time.h>

#include "shell_calls.h"
#include "shell_object.h"

static PyObject *why_name; /* "why", interned */

static double monotonic_s(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now); /* time.monotonic()'s clock */
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* The header in the group's layout, little-endian as x86 and arm64 store it, as the Python
 * paths pack it (ring/plumbing.py Plumbing.header and RingBackend.barrier; jaccl/local.py _run).
 * seq: the count of collectives before this one (the ring's headers carry it, JACCL's carry this
 * one's number). */
static void pack_header(Shell *self, const shell_call *c, uint64_t seq) {
    unsigned char *h = self->header;
    int reducing = c->kind == SHELL_ALL_REDUCE || c->kind == SHELL_REDUCE_SCATTER;
    uint64_t nbytes = c->kind == SHELL_BARRIER ? 0 : c->nbytes;
    memset(h, 0, JL_HEADER_BYTES);
    if (self->layout == SHELL_JACCL) {
        uint32_t own = (uint32_t)(seq + 1);
        int32_t extra = c->kind == SHELL_BROADCAST ? c->root : 0;
        h[0] = self->op_codes[c->kind];
        h[1] = reducing ? (unsigned char)self->extra[c->op] : 0;
        h[2] = (unsigned char)c->dtype;
        memcpy(h + 4, &own, 4);
        memcpy(h + 12, &extra, 4);
        memcpy(h + 16, &nbytes, 8);
        return;
    }
    uint32_t seq32 = (uint32_t)seq;
    int64_t extra = reducing                        ? self->extra[c->op]
                    : c->kind == SHELL_BROADCAST    ? c->root + self->stage
                    : c->kind == SHELL_ALL_GATHER   ? self->stage
                                                    : 0; /* barrier */
    memcpy(h, &self->magic, 2);
    h[2] = self->op_codes[c->kind];
    h[3] = (unsigned char)c->dtype;
    memcpy(h + 4, &seq32, 4);
    memcpy(h + 8, &nbytes, 8);
    memcpy(h + 16, &extra, 8);
}

/* A collective failed: the group's failure handler words and raises it (lock held). */
static void hand_failure(Shell *self, int rc, const jl_status *st, double deadline) {
    PyObject *what;
    if (rc == JL_INTERRUPTED && PyErr_Occurred()) {
        PyObject *type, *value, *trace;
        PyErr_Fetch(&type, &value, &trace);
        PyErr_NormalizeException(&type, &value, &trace);
        if (trace != NULL)
            PyException_SetTraceback(value, trace);
        Py_XDECREF(type);
        Py_XDECREF(trace);
        what = value;
    } else {
        what = jl_status_tuple(st);
    }
    if (what == NULL)
        return;
    PyObject *r = PyObject_CallFunction(self->failed, "y#dO", (const char *)self->header, (Py_ssize_t)JL_HEADER_BYTES,
                                        deadline, what);
    Py_DECREF(what);
    if (r != NULL) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_SystemError, "the shared-memory failure handler returned without raising");
    }
}

/* The engine's call for one collective (no GIL held). */
static int engine_call(jl_ctx *ctx, const shell_call *c, const unsigned char *h, int64_t deadline_ns, jl_status *st) {
    switch (c->kind) {
    case SHELL_ALL_REDUCE:
        return jl_all_reduce(ctx, c->src, c->dst, c->count, c->dtype, c->op, h, deadline_ns, st);
    case SHELL_REDUCE_SCATTER:
        return jl_reduce_scatter(ctx, c->src, c->dst, c->count, c->dtype, c->op, h, deadline_ns, st);
    case SHELL_ALL_GATHER:
        return jl_all_gather(ctx, c->src, c->dst, c->count, c->dtype, h, deadline_ns, st);
    case SHELL_BROADCAST:
        return jl_broadcast(ctx, c->dst, c->count, c->dtype, c->root, h, deadline_ns, st);
    default:
        return jl_barrier(ctx, h, deadline_ns, st);
    }
}

PyObject *jl_shell_run(Shell *self, const shell_call *call, PyObject *keep, PyObject *result) {
    int taken = jl_lock_take(self->lock, !self->refuse);
    if (taken <= 0)
        goto not_taken; /* < 0: an error; 0: another thread runs a collective (the Python path
                         * refuses, in its words) */
    PyObject *why = PyObject_GetAttr(self->failure, why_name);
    if (why == NULL) {
        jl_lock_give(self->lock);
        taken = -1;
        goto not_taken;
    }
    int given_up = why != Py_None;
    Py_DECREF(why);
    jl_ctx *ctx = self->segment->ctx; /* closed while this thread waited for the lock? */
    if (given_up || ctx == NULL) {
        jl_lock_give(self->lock); /* the Python path raises what the group's state says */
        taken = 0;
        goto not_taken;
    }
    pack_header(self, call, jl_next_sequence(ctx));
    double deadline = monotonic_s() + self->timeout;
    int64_t deadline_ns = (isinf(deadline) || deadline * 1e9 >= 9.2e18) ? JL_NO_DEADLINE : (int64_t)(deadline * 1e9);
    jl_status st;
    int rc;
    self->segment->running = self->header;
    Py_BEGIN_ALLOW_THREADS
    rc = engine_call(ctx, call, self->header, deadline_ns, &st);
    Py_END_ALLOW_THREADS
    self->segment->running = NULL;
    Py_XDECREF(keep);
    if (rc != JL_OK)
        hand_failure(self, rc, &st, deadline);
    jl_lock_give(self->lock);
    if (rc != JL_OK) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
not_taken:
    Py_XDECREF(keep);
    Py_DECREF(result);
    if (taken < 0)
        return NULL;
    Py_RETURN_NOTIMPLEMENTED;
}

static void dtypes_clear(Shell *self) {
    for (int i = 0; i < self->ndtypes; i++)
        Py_CLEAR(self->dtypes[i]);
    self->ndtypes = 0;
}

/* The (dtype, code) pairs: a sequence of 2-tuples, at most 2 x JL_DTYPES. */
static int dtype_table(Shell *self, PyObject *pairs) {
    PyObject *fast = PySequence_Fast(pairs, "dtypes");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > 2 * JL_DTYPES) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "dtypes: at most %d", 2 * JL_DTYPES);
        return -1;
    }
    dtypes_clear(self);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *dtype;
        int code;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "Oi", &dtype, &code)) {
            Py_DECREF(fast);
            return -1;
        }
        if (code <= 0 || code >= JL_DTYPES || jl_dtype_size(code) == 0) {
            Py_DECREF(fast);
            PyErr_Format(PyExc_ValueError, "dtypes: unknown code %d", code);
            return -1;
        }
        Py_INCREF(dtype);
        self->dtypes[self->ndtypes] = dtype;
        self->codes[self->ndtypes++] = code;
    }
    Py_DECREF(fast);
    return 0;
}

/* `n` integers from a sequence (what: its name in errors). 0, or -1 with an exception set. */
static int integers(PyObject *seq, const char *what, int n, int64_t *out) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s: %d integers", what, n);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        out[i] = (int64_t)v;
    }
    Py_DECREF(fast);
    return 0;
}

/* Shell(segment, lock, failure, failed, timeout, magic, op_codes, extras, reducible, dtypes,
 * layout=0, refuse=False, tensors=None, stage=0): op_codes, the header's operation of all_reduce,
 * reduce_scatter, all_gather, broadcast and barrier; extras, the header's extra field (the
 * ring's) or reduce byte (JACCL's) per jl_op (7 ints); reducible, 16 bytes by dtype code, bit
 * op set where the library accepts (dtype, op); dtypes, (numpy dtype, engine code) pairs;
 * layout, SHELL_RING or SHELL_JACCL; refuse, whether a busy lock means NotImplemented (the group
 * refuses a second thread) rather than a wait; tensors, a function returning None until torch
 * is imported, then (torch.Tensor, (torch dtype, engine code) pairs, torch.empty_like,
 * torch.strided); stage, the ring's addition to the extra field of all_gather and broadcast. */
static int Shell_init(Shell *self, PyObject *args, PyObject *kwargs) {
    PyObject *segment, *lock, *failure, *failed, *op_codes, *extras, *dtypes;
    double timeout;
    int magic;
    const char *reducible;
    Py_ssize_t reducible_len;
    int layout = SHELL_RING, refuse = 0;
    long long stage = 0;
    PyObject *tensors = Py_None;
    static char *keywords[] = {"segment", "lock", "failure", "failed", "timeout", "magic", "op_codes",
                               "extras", "reducible", "dtypes", "layout", "refuse", "tensors", "stage", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!OOdiOOy#O|ipOL", keywords, &SegmentType, &segment, &LockType,
                                     &lock, &failure, &failed, &timeout, &magic, &op_codes, &extras, &reducible,
                                     &reducible_len, &dtypes, &layout, &refuse, &tensors, &stage))
        return -1;
    int64_t codes[SHELL_KINDS];
    if (jl_shell_calls_ready() < 0 || dtype_table(self, dtypes) < 0 ||
        jl_tensors_init(&self->tensors, tensors) < 0 || integers(extras, "extras", JL_OPS, self->extra) < 0 ||
        integers(op_codes, "op_codes", SHELL_KINDS, codes) < 0)
        return -1;
    if (layout != SHELL_RING && layout != SHELL_JACCL) {
        PyErr_Format(PyExc_ValueError, "unknown header layout %d", layout);
        return -1;
    }
    if (reducible_len != JL_DTYPES) {
        PyErr_Format(PyExc_ValueError, "reducible: %d bytes, one per dtype code", JL_DTYPES);
        return -1;
    }
    for (int i = 0; i < SHELL_KINDS; i++)
        self->op_codes[i] = (uint8_t)codes[i];
    memcpy(self->reducible, reducible, JL_DTYPES);
    self->timeout = timeout;
    self->layout = layout;
    self->refuse = refuse;
    self->magic = (uint16_t)magic;
    self->stage = (int64_t)stage;
    Py_INCREF(segment);
    Py_XSETREF(self->segment, (Segment *)segment);
    Py_INCREF(lock);
    Py_XSETREF(self->lock, (Lock *)lock);
    Py_INCREF(failure);
    Py_XSETREF(self->failure, failure);
    Py_INCREF(failed);
    Py_XSETREF(self->failed, failed);
    return 0;
}

static void Shell_dealloc(Shell *self) {
    dtypes_clear(self);
    jl_tensors_clear(&self->tensors);
    Py_XDECREF(self->segment);
    Py_XDECREF(self->lock);
    Py_XDECREF(self->failure);
    Py_XDECREF(self->failed);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Shell_get_timeout(Shell *self, void *Py_UNUSED(closure)) {
    return PyFloat_FromDouble(self->timeout);
}

static int Shell_set_timeout(Shell *self, PyObject *value, void *Py_UNUSED(closure)) {
    double t = value == NULL ? -1.0 : PyFloat_AsDouble(value);
    if (t == -1.0 && (value == NULL || PyErr_Occurred())) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_AttributeError, "the timeout cannot be deleted");
        return -1;
    }
    self->timeout = t;
    return 0;
}

#define SHELL_METHOD(name, doc) {#name, (PyCFunction)(void (*)(void))jl_shell_##name, METH_FASTCALL, doc}

static PyMethodDef Shell_methods[] = {
    SHELL_METHOD(all_reduce, "all_reduce(x, out, op) -> the result, or NotImplemented (the Python path's call)"),
    SHELL_METHOD(reduce_scatter, "reduce_scatter(x, out, op) -> this rank's block, or NotImplemented"),
    SHELL_METHOD(all_gather, "all_gather(x, out) -> every rank's x in rank order, or NotImplemented"),
    SHELL_METHOD(broadcast, "broadcast(x, out, root) -> root's x, or NotImplemented"),
    SHELL_METHOD(barrier, "barrier() -> None, or NotImplemented"),
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Shell_getset[] = {
    {"timeout", (getter)Shell_get_timeout, (setter)Shell_set_timeout, "seconds per collective", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ShellType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "adapter.backends.local._engine.Shell",
    .tp_basicsize = sizeof(Shell),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A group's collectives over its segment, each in one call (csrc/python/shell.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Shell_init,
    .tp_dealloc = (destructor)Shell_dealloc,
    .tp_methods = Shell_methods,
    .tp_getset = Shell_getset,
};

int jl_shell_add_types(PyObject *module) {
    why_name = PyUnicode_InternFromString("why");
    if (why_name == NULL || jl_lock_add_type(module) < 0 || PyType_Ready(&ShellType) < 0)
        return -1;
    Py_INCREF(&ShellType);
    if (PyModule_AddObject(module, "Shell", (PyObject *)&ShellType) < 0) {
        Py_DECREF(&ShellType);
        return -1;
    }
    return 0;
}
