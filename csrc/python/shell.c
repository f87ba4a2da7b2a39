/* The binding's fast path: one C call from adapter.ops to jl_all_reduce.
 *
 * Shell: what a group's Python shell (adapter/backends/local/shell.py) does around an all_reduce
 * over its segment (the lock, the "given up" check, the sequence number, the header in the ring's
 * or JACCL's layout, the deadline) for the common cases only: an exact numpy array, C-contiguous
 * and aligned, a dtype of the group's table (native byte order, bfloat16 included) and an op the
 * library accepts for it, in place (out=x), into a separate array of its shape and dtype, or into
 * a fresh array; or the same with plain torch CPU tensors (tensors.c). Anything else returns
 * NotImplemented before anything happened, and the caller runs its Python path, which words every
 * refusal as it always did. A failed collective goes to the group's Python failure handler
 * (failed(header, deadline, status tuple or exception), called with the lock held; it raises),
 * so every exception and message is the Python path's.
 *
 * The arrays are read through numpy's C API (their flags, descriptor and data pointer), not the
 * buffer protocol: a buffer request makes numpy build (and, for a fresh array, allocate) a
 * description of the array at every call. Nothing is allocated on success beyond a fresh
 * result, made like x by numpy without a Python call (by torch.empty_like for a tensor). */
#include "shell.h"

#include <math.h>
#include <string.h>
#include <time.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include "lock.h"
#include "segment_object.h"
#include "tensors.h"

#define JL_OPS 7
#define JL_DTYPES 16
#define SHELL_RING 0  /* ring/header.py "<HBBIQq": magic, op, dtype, count so far, bytes, extra */
#define SHELL_JACCL 1 /* jaccl/frame_header.py "<BBBBIIiQ": op, reduce, dtype, 0, own number, 0, 0, bytes */

/* ---- Shell ------------------------------------------------------------------------------ */

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
    uint8_t op_code;               /* the header's operation (all_reduce) */
    int64_t extra[JL_OPS];         /* the header's extra field per jl_op */
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

static PyObject *why_name; /* "why", interned */

/* The engine's dtype code of a numpy array (by its descriptor's identity), 0 when the fast path
 * does not take it: another byte order, a non-numeric type. */
static int dtype_of(Shell *self, PyArrayObject *arr) {
    PyObject *dtype = (PyObject *)PyArray_DESCR(arr);
    for (int i = 0; i < self->ndtypes; i++)
        if (self->dtypes[i] == dtype)
            return self->codes[i];
    return 0;
}

/* What the fast path needs of an array: C-contiguous and aligned (the engine reads whole
 * elements), writable where written. */
static int usable(PyArrayObject *arr, int writable) {
    int need = NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | (writable ? NPY_ARRAY_WRITEABLE : 0);
    return (PyArray_FLAGS(arr) & need) == need;
}

static int same_shape(PyArrayObject *a, PyArrayObject *b) {
    int nd = PyArray_NDIM(a);
    if (nd != PyArray_NDIM(b))
        return 0;
    npy_intp *sa = PyArray_DIMS(a), *sb = PyArray_DIMS(b);
    for (int i = 0; i < nd; i++)
        if (sa[i] != sb[i])
            return 0;
    return 1;
}

static double monotonic_s(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now); /* time.monotonic()'s clock */
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

/* The header in the group's layout, little-endian as x86 and arm64 store it. seq: the count of
 * collectives before this one (the ring's headers carry it, JACCL's carry this one's number). */
static void pack_header(Shell *self, int dtype, uint64_t seq, uint64_t nbytes, int op) {
    unsigned char *h = self->header;
    memset(h, 0, JL_HEADER_BYTES);
    if (self->layout == SHELL_JACCL) {
        uint32_t own = (uint32_t)(seq + 1);
        h[0] = self->op_code;
        h[1] = (unsigned char)self->extra[op];
        h[2] = (unsigned char)dtype;
        memcpy(h + 4, &own, 4);
        memcpy(h + 16, &nbytes, 8);
        return;
    }
    uint32_t seq32 = (uint32_t)seq;
    memcpy(h, &self->magic, 2);
    h[2] = self->op_code;
    h[3] = (unsigned char)dtype;
    memcpy(h + 4, &seq32, 4);
    memcpy(h + 8, &nbytes, 8);
    memcpy(h + 16, &self->extra[op], 8);
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

/* Runs the all_reduce of `bytes` at `from` into `into` as the group's next collective: the
 * lock, the "given up" check, the header, the deadline, the engine's call without the GIL.
 * Takes over the references to keep (the input, held for the call: an array another thread
 * could resize or free meanwhile) and result (returned on success). */
static PyObject *run(Shell *self, PyObject *keep, PyObject *result, const void *from, void *into, size_t bytes,
                     int dtype, int op) {
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
    pack_header(self, dtype, jl_next_sequence(ctx), (uint64_t)bytes, op);
    double deadline = monotonic_s() + self->timeout;
    int64_t deadline_ns = (isinf(deadline) || deadline * 1e9 >= 9.2e18) ? JL_NO_DEADLINE : (int64_t)(deadline * 1e9);
    jl_status st;
    int rc;
    self->segment->running = self->header;
    Py_BEGIN_ALLOW_THREADS
    rc = jl_all_reduce(ctx, from, into, bytes / jl_dtype_size(dtype), dtype, op, self->header, deadline_ns, &st);
    Py_END_ALLOW_THREADS
    self->segment->running = NULL;
    Py_DECREF(keep);
    if (rc != JL_OK)
        hand_failure(self, rc, &st, deadline);
    jl_lock_give(self->lock);
    if (rc != JL_OK) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
not_taken:
    Py_DECREF(keep);
    Py_DECREF(result);
    if (taken < 0)
        return NULL;
    Py_RETURN_NOTIMPLEMENTED;
}

/* all_reduce of numpy arrays: x exact, out x, None or an exact array. */
static PyObject *arrays_all_reduce(Shell *self, PyObject *x, PyObject *out, int op) {
    if (out != x && out != Py_None && !PyArray_CheckExact(out))
        Py_RETURN_NOTIMPLEMENTED;
    PyArrayObject *src = (PyArrayObject *)x;
    int dtype = dtype_of(self, src);
    if (dtype == 0 || !(self->reducible[dtype] >> op & 1) || !usable(src, out == x) ||
        (size_t)PyArray_ITEMSIZE(src) != jl_dtype_size(dtype))
        Py_RETURN_NOTIMPLEMENTED;
    PyArrayObject *dst = src;
    if (out == Py_None) {
        /* like x (C-contiguous): its dtype and shape, a base-class array; NewFromDescr takes a
         * reference to the descriptor */
        PyArray_Descr *descr = PyArray_DESCR(src);
        Py_INCREF(descr);
        dst = (PyArrayObject *)PyArray_NewFromDescr(&PyArray_Type, descr, PyArray_NDIM(src), PyArray_DIMS(src), NULL,
                                                    NULL, 0, NULL);
        if (dst == NULL)
            return NULL;
    } else if (out != x) {
        dst = (PyArrayObject *)out;
        const char *a = PyArray_BYTES(src), *b = PyArray_BYTES(dst);
        npy_intp len = PyArray_NBYTES(src);
        if (dtype_of(self, dst) != dtype || !usable(dst, 1) || !same_shape(src, dst) || !(a + len <= b || b + len <= a))
            Py_RETURN_NOTIMPLEMENTED; /* the Python path refuses it, or finds it in place, and says so */
        Py_INCREF(dst);
    } else {
        Py_INCREF(dst);
    }
    Py_INCREF(src);
    return run(self, x, (PyObject *)dst, PyArray_DATA(src), PyArray_DATA(dst), (size_t)PyArray_NBYTES(src), dtype, op);
}

/* all_reduce of plain CPU tensors: x exactly a torch.Tensor; out x, None or another. A fresh
 * result is taken for an x that requires grad too (the result does not, as on the Python path);
 * in place or into out= it is not (the Python path decides what writing into it means). */
static PyObject *tensors_all_reduce(Shell *self, PyObject *x, PyObject *out, int op) {
    jl_tensor_view src, dst;
    int r = jl_tensors_view(&self->tensors, x, out == Py_None, &src);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    if (!(self->reducible[src.dtype] >> op & 1))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *result;
    if (out == Py_None) {
        if ((result = jl_tensors_empty_like(&self->tensors, x, &dst.data)) == NULL)
            return NULL;
    } else if (out != x) {
        /* a plain tensor of x's dtype and shape in memory apart from x's; anything else the
         * Python path refuses, or finds in place, and says so */
        r = jl_tensors_is_tensor(&self->tensors, out);
        if (r > 0)
            r = jl_tensors_view(&self->tensors, out, 0, &dst);
        if (r > 0)
            r = dst.dtype == src.dtype && (src.data + src.nbytes <= dst.data || dst.data + dst.nbytes <= src.data);
        if (r > 0 && (r = jl_tensors_same_shape(x, out)) < 0) {
            PyErr_Clear(); /* the Python path reads the shapes again and words what failed */
            r = 0;
        }
        if (r <= 0)
            return r < 0 ? NULL : Py_NewRef(Py_NotImplemented);
        result = Py_NewRef(out);
    } else {
        dst = src;
        result = Py_NewRef(out);
    }
    return run(self, Py_NewRef(x), result, src.data, dst.data, src.nbytes, src.dtype, op);
}

/* all_reduce(x, out, op): op a jl_op; out x (in place), None (a fresh result) or a separate
 * array or tensor of x's kind. Returns the result, or NotImplemented when this call is not the
 * fast path's. */
static PyObject *Shell_all_reduce(Shell *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 3) {
        PyErr_Format(PyExc_TypeError, "all_reduce takes 3 arguments (%zd given)", n);
        return NULL;
    }
    PyObject *x = args[0], *out = args[1];
    int overflow;
    long op = PyLong_AsLongAndOverflow(args[2], &overflow);
    if (self->segment->ctx == NULL || op < 0 || op >= JL_OPS) {
        PyErr_Clear(); /* a non-integer op: the Python path says so */
        Py_RETURN_NOTIMPLEMENTED;
    }
    if (PyArray_CheckExact(x))
        return arrays_all_reduce(self, x, out, (int)op);
    int r = jl_tensors_is_tensor(&self->tensors, x);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    return tensors_all_reduce(self, x, out, (int)op);
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

/* Shell(segment, lock, failure, failed, timeout, magic, op_code, extras, reducible, dtypes,
 * layout=0, refuse=False, tensors=None): dtypes, (numpy dtype, engine code) pairs; extras, the
 * header's extra field (the ring's) or reduce byte (JACCL's) per jl_op (7 ints); reducible, 16
 * bytes by dtype code, bit op set where the library accepts (dtype, op); layout, SHELL_RING or
 * SHELL_JACCL; refuse, whether a busy lock means NotImplemented (the group refuses a second
 * thread) rather than a wait; tensors, a function returning None until torch is imported, then
 * (torch.Tensor, (torch dtype, engine code) pairs, torch.empty_like, torch.strided). */
static int Shell_init(Shell *self, PyObject *args, PyObject *kwargs) {
    PyObject *segment, *lock, *failure, *failed, *extras, *dtypes;
    double timeout;
    int magic, op_code;
    const char *reducible;
    Py_ssize_t reducible_len;
    int layout = SHELL_RING, refuse = 0;
    PyObject *tensors = Py_None;
    static char *keywords[] = {"segment", "lock", "failure", "failed", "timeout", "magic", "op_code",
                               "extras", "reducible", "dtypes", "layout", "refuse", "tensors", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!OOdiiOy#O|ipO", keywords, &SegmentType, &segment, &LockType,
                                     &lock, &failure, &failed, &timeout, &magic, &op_code, &extras, &reducible,
                                     &reducible_len, &dtypes, &layout, &refuse, &tensors))
        return -1;
    /* numpy's C API, looked up when the first group makes its shell (numpy is imported by
     * then; importing the engine alone does not import it) */
    if (PyArray_API == NULL && _import_array() < 0)
        return -1;
    if (dtype_table(self, dtypes) < 0 || jl_tensors_init(&self->tensors, tensors) < 0)
        return -1;
    if (layout != SHELL_RING && layout != SHELL_JACCL) {
        PyErr_Format(PyExc_ValueError, "unknown header layout %d", layout);
        return -1;
    }
    if (reducible_len != JL_DTYPES) {
        PyErr_Format(PyExc_ValueError, "reducible: %d bytes, one per dtype code", JL_DTYPES);
        return -1;
    }
    PyObject *fast = PySequence_Fast(extras, "extras");
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != JL_OPS) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "extras: one per reduction, %d", JL_OPS);
        return -1;
    }
    for (int i = 0; i < JL_OPS; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        self->extra[i] = (int64_t)v;
    }
    Py_DECREF(fast);
    memcpy(self->reducible, reducible, JL_DTYPES);
    self->timeout = timeout;
    self->layout = layout;
    self->refuse = refuse;
    self->magic = (uint16_t)magic;
    self->op_code = (uint8_t)op_code;
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

static PyMethodDef Shell_methods[] = {
    {"all_reduce", (PyCFunction)(void (*)(void))Shell_all_reduce, METH_FASTCALL,
     "all_reduce(x, out, op) -> the result, or NotImplemented (the Python path's call)"},
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
    .tp_doc = "A group's all_reduce of numpy arrays over its segment in one call (csrc/python/shell.c).",
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
