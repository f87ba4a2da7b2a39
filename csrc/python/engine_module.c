/* adapter.backends.local._engine: the CPython binding of the shared-memory engine (csrc/shm).
 *
 * One type, Segment: an attached segment. Its collectives take objects with the buffer protocol
 * (one parser, buffer()), release the GIL around the whole call (every wait is inside it) and
 * return None, or on failure the engine's status as a tuple (code, peer, culprit, fd, errno,
 * step, peer_step, header) that adapter/backends/local/engine.py turns into today's exceptions.
 * Nothing is allocated per call on the success path. The module also exports the engine's
 * function table as the capsule API (see csrc/shm/engine.h). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

#include "../shm/engine.h"
#include "../shm/probe.h"

typedef struct {
    PyObject_HEAD
    jl_ctx *ctx;
    PyObject *stall; /* callable(peer member) or NULL */
    jl_settings settings;
} Segment;

static void stall_report(void *arg, int32_t peer) {
    Segment *self = arg;
    PyGILState_STATE gil = PyGILState_Ensure();
    if (self->stall != NULL) {
        PyObject *res = PyObject_CallFunction(self->stall, "i", (int)peer);
        if (res == NULL)
            PyErr_WriteUnraisable(self->stall);
        Py_XDECREF(res);
    }
    PyGILState_Release(gil);
}

/* A signal woke a wait: run Python's handlers now (a raised KeyboardInterrupt stays set and
 * ends the call), as the Python engine's loop did between its sleeps. */
static int interrupted(void *arg) {
    (void)arg;
    PyGILState_STATE gil = PyGILState_Ensure();
    int raised = PyErr_CheckSignals() < 0;
    PyGILState_Release(gil);
    return raised;
}

static PyObject *status_tuple(const jl_status *st) {
    return Py_BuildValue("iiiiiKKy#", st->code, st->peer, st->culprit, st->fd, st->sys_errno,
                         (unsigned long long)st->step, (unsigned long long)st->peer_step,
                         (const char *)st->header, (Py_ssize_t)JL_HEADER_BYTES);
}

static int closed(Segment *self) {
    if (self->ctx == NULL) {
        PyErr_SetString(PyExc_ValueError, "the shared-memory segment is closed");
        return 1;
    }
    return 0;
}

/* The one buffer parser: a C-contiguous buffer (writable when asked). */
static int buffer(PyObject *obj, Py_buffer *view, int writable) {
    return PyObject_GetBuffer(obj, view, writable ? (PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) : PyBUF_C_CONTIGUOUS);
}

/* A 24-byte header, or NULL for None (no check). -1 on a bad argument. */
static int header_arg(PyObject *obj, const unsigned char **out) {
    if (obj == Py_None) {
        *out = NULL;
        return 0;
    }
    if (!PyBytes_Check(obj) || PyBytes_GET_SIZE(obj) != JL_HEADER_BYTES) {
        PyErr_Format(PyExc_ValueError, "a collective header is %d bytes", JL_HEADER_BYTES);
        return -1;
    }
    *out = (const unsigned char *)PyBytes_AS_STRING(obj);
    return 0;
}

/* time.monotonic() seconds -> CLOCK_MONOTONIC nanoseconds; inf: none. */
static int deadline_arg(PyObject *obj, int64_t *out) {
    double d = PyFloat_AsDouble(obj);
    if (d == -1.0 && PyErr_Occurred())
        return -1;
    *out = (isinf(d) || d * 1e9 >= 9.2e18) ? JL_NO_DEADLINE : (int64_t)(d * 1e9);
    return 0;
}

static int int_arg(PyObject *obj, int *out) {
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = (int)v;
    return 0;
}

static PyObject *result(int rc, const jl_status *st) {
    if (rc == JL_OK)
        Py_RETURN_NONE;
    if (rc == JL_INTERRUPTED && PyErr_Occurred())
        return NULL; /* the signal handler's exception */
    return status_tuple(st);
}

static int nargs(Py_ssize_t got, Py_ssize_t want, const char *name) {
    if (got != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, got);
        return -1;
    }
    return 0;
}

/* all_reduce(src, dst, dtype, op, header, deadline) */
static PyObject *Segment_all_reduce(Segment *self, PyObject *const *args, Py_ssize_t n) {
    int dtype, op;
    const unsigned char *header;
    int64_t deadline;
    if (nargs(n, 6, "all_reduce") || closed(self) || int_arg(args[2], &dtype) || int_arg(args[3], &op) ||
        header_arg(args[4], &header) || deadline_arg(args[5], &deadline))
        return NULL;
    size_t item = jl_dtype_size(dtype);
    if (item == 0)
        return PyErr_Format(PyExc_TypeError, "unknown dtype code %d", dtype);
    Py_buffer src, dst;
    if (buffer(args[0], &src, 0) < 0)
        return NULL;
    if (buffer(args[1], &dst, 1) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    jl_status st;
    int rc;
    if (src.len != dst.len || src.len % (Py_ssize_t)item) {
        PyErr_Format(PyExc_ValueError, "all_reduce: input of %zd bytes, output of %zd", src.len, dst.len);
        rc = -1;
    } else {
        Py_BEGIN_ALLOW_THREADS
        rc = jl_all_reduce(self->ctx, src.buf, dst.buf, (size_t)src.len / item, dtype, op, header, deadline, &st);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return rc < 0 ? NULL : result(rc, &st);
}

/* reduce_scatter(src, dst, dtype, op, header, deadline) */
static PyObject *Segment_reduce_scatter(Segment *self, PyObject *const *args, Py_ssize_t n) {
    int dtype, op;
    const unsigned char *header;
    int64_t deadline;
    if (nargs(n, 6, "reduce_scatter") || closed(self) || int_arg(args[2], &dtype) || int_arg(args[3], &op) ||
        header_arg(args[4], &header) || deadline_arg(args[5], &deadline))
        return NULL;
    size_t item = jl_dtype_size(dtype);
    if (item == 0)
        return PyErr_Format(PyExc_TypeError, "unknown dtype code %d", dtype);
    Py_buffer src, dst;
    if (buffer(args[0], &src, 0) < 0)
        return NULL;
    if (buffer(args[1], &dst, 1) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    jl_status st;
    int rc;
    if (src.len != dst.len * jl_size(self->ctx) || dst.len % (Py_ssize_t)item) {
        PyErr_Format(PyExc_ValueError, "reduce_scatter: input of %zd bytes, output of %zd", src.len, dst.len);
        rc = -1;
    } else {
        Py_BEGIN_ALLOW_THREADS
        rc = jl_reduce_scatter(self->ctx, src.buf, dst.buf, (size_t)dst.len / item, dtype, op, header, deadline, &st);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return rc < 0 ? NULL : result(rc, &st);
}

/* all_gather(src, dst, dtype, header, deadline) */
static PyObject *Segment_all_gather(Segment *self, PyObject *const *args, Py_ssize_t n) {
    int dtype;
    const unsigned char *header;
    int64_t deadline;
    if (nargs(n, 5, "all_gather") || closed(self) || int_arg(args[2], &dtype) || header_arg(args[3], &header) ||
        deadline_arg(args[4], &deadline))
        return NULL;
    size_t item = jl_dtype_size(dtype);
    if (item == 0)
        return PyErr_Format(PyExc_TypeError, "unknown dtype code %d", dtype);
    Py_buffer src, dst;
    if (buffer(args[0], &src, 0) < 0)
        return NULL;
    if (buffer(args[1], &dst, 1) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    jl_status st;
    int rc;
    if (dst.len != src.len * jl_size(self->ctx) || src.len % (Py_ssize_t)item) {
        PyErr_Format(PyExc_ValueError, "all_gather: input of %zd bytes, output of %zd", src.len, dst.len);
        rc = -1;
    } else {
        Py_BEGIN_ALLOW_THREADS
        rc = jl_all_gather(self->ctx, src.buf, dst.buf, (size_t)src.len / item, dtype, header, deadline, &st);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return rc < 0 ? NULL : result(rc, &st);
}

/* broadcast(buf, dtype, root, header, deadline) */
static PyObject *Segment_broadcast(Segment *self, PyObject *const *args, Py_ssize_t n) {
    int dtype, root;
    const unsigned char *header;
    int64_t deadline;
    if (nargs(n, 5, "broadcast") || closed(self) || int_arg(args[1], &dtype) || int_arg(args[2], &root) ||
        header_arg(args[3], &header) || deadline_arg(args[4], &deadline))
        return NULL;
    size_t item = jl_dtype_size(dtype);
    if (item == 0)
        return PyErr_Format(PyExc_TypeError, "unknown dtype code %d", dtype);
    Py_buffer buf;
    if (buffer(args[0], &buf, 1) < 0)
        return NULL;
    jl_status st;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = jl_broadcast(self->ctx, buf.buf, (size_t)buf.len / item, dtype, root, header, deadline, &st);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return result(rc, &st);
}

/* barrier(header, deadline) */
static PyObject *Segment_barrier(Segment *self, PyObject *const *args, Py_ssize_t n) {
    const unsigned char *header;
    int64_t deadline;
    if (nargs(n, 2, "barrier") || closed(self) || header_arg(args[0], &header) || deadline_arg(args[1], &deadline))
        return NULL;
    jl_status st;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = jl_barrier(self->ctx, header, deadline, &st);
    Py_END_ALLOW_THREADS
    return result(rc, &st);
}

static PyObject *Segment_mark_broken(Segment *self, PyObject *arg) {
    int culprit;
    if (int_arg(arg, &culprit))
        return NULL;
    if (self->ctx != NULL)
        jl_mark_broken(self->ctx, culprit);
    Py_RETURN_NONE;
}

static PyObject *Segment_watch(Segment *self, PyObject *args) {
    int fd, peer;
    if (!PyArg_ParseTuple(args, "ii", &fd, &peer) || closed(self))
        return NULL;
    jl_status st;
    if (jl_watch(self->ctx, fd, peer, &st) != JL_OK)
        return PyErr_Format(PyExc_ValueError, "too many sockets watched by one segment");
    Py_RETURN_NONE;
}

/* configure(small_bytes, spin_ns, yield_ns, stall_report_ns) */
static int settings_arg(Segment *self, PyObject *args) {
    unsigned long long small;
    long long spin, yield, stall;
    if (!PyArg_ParseTuple(args, "KLLL", &small, &spin, &yield, &stall))
        return -1;
    self->settings.small_bytes = (size_t)small;
    self->settings.spin_ns = spin;
    self->settings.yield_ns = yield;
    self->settings.stall_report_ns = stall;
    self->settings.stall_report = stall_report;
    self->settings.stall_arg = self;
    self->settings.interrupted = interrupted;
    return 0;
}

static PyObject *Segment_configure(Segment *self, PyObject *args) {
    if (settings_arg(self, args) || closed(self))
        return NULL;
    jl_configure(self->ctx, &self->settings);
    Py_RETURN_NONE;
}

static PyObject *Segment_close(Segment *self, PyObject *Py_UNUSED(unused)) {
    jl_detach(self->ctx);
    self->ctx = NULL;
    Py_RETURN_NONE;
}

static PyObject *Segment_context(Segment *self, PyObject *Py_UNUSED(unused)) {
    if (closed(self))
        return NULL;
    return PyCapsule_New(self->ctx, "jl_ctx", NULL);
}

static PyObject *Segment_step(Segment *self, void *Py_UNUSED(closure)) {
    if (closed(self))
        return NULL;
    return PyLong_FromUnsignedLongLong(jl_step(self->ctx));
}

/* The group's sequence number (jl_sequence): read and set by Python's paths while attached. */
static PyObject *Segment_get_sequence(Segment *self, void *Py_UNUSED(closure)) {
    if (closed(self))
        return NULL;
    return PyLong_FromUnsignedLongLong(jl_sequence(self->ctx));
}

static int Segment_set_sequence(Segment *self, PyObject *value, void *Py_UNUSED(closure)) {
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "the sequence cannot be deleted");
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(value);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (closed(self))
        return -1;
    jl_set_sequence(self->ctx, (uint64_t)v);
    return 0;
}

static int int_list(PyObject *seq, int32_t *out, Py_ssize_t want, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != want) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s: expected %zd entries", what, want);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        out[i] = (int32_t)v;
    }
    Py_DECREF(fast);
    return 0;
}

/* Segment(fd, member, size, chunk_bytes, names, pids, settings tuple, stall callable or None).
 * Errors: OSError (a system call), ValueError (the segment's size or the arguments). */
static int Segment_init(Segment *self, PyObject *args, PyObject *kwargs) {
    int fd, member, size;
    unsigned long long chunk;
    PyObject *names_obj, *pids_obj, *settings, *stall;
    static char *keywords[] = {"fd", "member", "size", "chunk_bytes", "names", "pids", "settings", "stall", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iiiKOOOO", keywords, &fd, &member, &size, &chunk, &names_obj,
                                     &pids_obj, &settings, &stall))
        return -1;
    if (size < 1 || size > JL_MAX_RANKS) {
        PyErr_Format(PyExc_ValueError, "a segment has 1 to %d members, not %d", JL_MAX_RANKS, size);
        return -1;
    }
    int32_t names[JL_MAX_RANKS], pids[JL_MAX_RANKS];
    if (int_list(names_obj, names, size, "names") || int_list(pids_obj, pids, size, "pids") ||
        settings_arg(self, settings))
        return -1;
    if (stall != Py_None) {
        Py_INCREF(stall);
        Py_XSETREF(self->stall, stall);
    }
    jl_status st;
    jl_detach(self->ctx);
    self->ctx = NULL;
    int rc = jl_attach(fd, member, size, (size_t)chunk, names, pids, &self->settings, &self->ctx, &st);
    if (rc == JL_SYSTEM) {
        errno = st.sys_errno;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (rc != JL_OK) {
        if (st.peer_step)
            PyErr_Format(PyExc_ValueError, "segment is %llu bytes, expected %llu", (unsigned long long)st.step,
                         (unsigned long long)st.peer_step);
        else
            PyErr_SetString(PyExc_ValueError, "invalid segment arguments");
        return -1;
    }
    return 0;
}

static void Segment_dealloc(Segment *self) {
    jl_detach(self->ctx);
    Py_XDECREF(self->stall);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Segment_methods[] = {
    {"all_reduce", (PyCFunction)(void (*)(void))Segment_all_reduce, METH_FASTCALL, "all_reduce(src, dst, dtype, op, header, deadline)"},
    {"reduce_scatter", (PyCFunction)(void (*)(void))Segment_reduce_scatter, METH_FASTCALL, "reduce_scatter(src, dst, dtype, op, header, deadline)"},
    {"all_gather", (PyCFunction)(void (*)(void))Segment_all_gather, METH_FASTCALL, "all_gather(src, dst, dtype, header, deadline)"},
    {"broadcast", (PyCFunction)(void (*)(void))Segment_broadcast, METH_FASTCALL, "broadcast(buf, dtype, root, header, deadline)"},
    {"barrier", (PyCFunction)(void (*)(void))Segment_barrier, METH_FASTCALL, "barrier(header, deadline)"},
    {"mark_broken", (PyCFunction)Segment_mark_broken, METH_O, "mark_broken(culprit)"},
    {"watch", (PyCFunction)Segment_watch, METH_VARARGS, "watch(fd, peer)"},
    {"configure", (PyCFunction)Segment_configure, METH_VARARGS, "configure(small_bytes, spin_ns, yield_ns, stall_report_ns)"},
    {"close", (PyCFunction)Segment_close, METH_NOARGS, "unmap the segment"},
    {"context", (PyCFunction)Segment_context, METH_NOARGS, "the jl_ctx * as a capsule named \"jl_ctx\""},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Segment_getset[] = {
    {"step", (getter)Segment_step, NULL, "steps run so far", NULL},
    {"sequence", (getter)Segment_get_sequence, (setter)Segment_set_sequence,
     "the group's collectives so far, the number in every header (jl_sequence)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SegmentType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "adapter.backends.local._engine.Segment",
    .tp_basicsize = sizeof(Segment),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An attached shared-memory segment (csrc/shm/engine.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Segment_init,
    .tp_dealloc = (destructor)Segment_dealloc,
    .tp_methods = Segment_methods,
    .tp_getset = Segment_getset,
};

static const jl_api API = {
    .abi_version = JL_ABI_VERSION,
    .struct_size = sizeof(jl_api),
    .all_reduce = jl_all_reduce,
    .reduce_scatter = jl_reduce_scatter,
    .all_gather = jl_all_gather,
    .broadcast = jl_broadcast,
    .barrier = jl_barrier,
    .mark_broken = jl_mark_broken,
    .member = jl_member,
    .size = jl_size,
    .step = jl_step,
    .dtype_size = jl_dtype_size,
    .sequence = jl_sequence,
    .set_sequence = jl_set_sequence,
    .next_sequence = jl_next_sequence,
};

/* cache_line_round_trip(cpu_a, cpu_b, rounds, trips) -> ns, fastest batch (csrc/shm/probe.h) */
static PyObject *cache_line_round_trip(PyObject *Py_UNUSED(module), PyObject *args) {
    int a, b, rounds, trips;
    if (!PyArg_ParseTuple(args, "iiii", &a, &b, &rounds, &trips))
        return NULL;
    double ns;
    Py_BEGIN_ALLOW_THREADS
    ns = jl_cache_line_round_trip(a, b, rounds, trips);
    Py_END_ALLOW_THREADS
    if (ns < 0) {
        errno = (int)-ns;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyFloat_FromDouble(ns);
}

static PyMethodDef module_methods[] = {
    {"cache_line_round_trip", cache_line_round_trip, METH_VARARGS,
     "cache_line_round_trip(cpu_a, cpu_b, rounds, trips): ns of a cache line's round trip between two CPUs"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_engine", "jacklring's shared-memory engine (csrc/shm).", -1, module_methods, NULL, NULL,
    NULL, NULL,
};

PyMODINIT_FUNC PyInit__engine(void) {
    if (PyType_Ready(&SegmentType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&SegmentType);
    if (PyModule_AddObject(m, "Segment", (PyObject *)&SegmentType) < 0)
        goto fail;
    PyObject *api = PyCapsule_New((void *)&API, "adapter.backends.local._engine.API", NULL);
    if (api == NULL || PyModule_AddObject(m, "API", api) < 0) {
        Py_XDECREF(api);
        goto fail;
    }
    if (PyModule_AddIntConstant(m, "ABI_VERSION", JL_ABI_VERSION) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
