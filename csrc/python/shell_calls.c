/* The fast path's collectives: what each takes, and the engine call it makes of it (see
 * shell_calls.h). Arrays are read through numpy's C API (their flags, descriptor and data
 * pointer), not the buffer protocol: a buffer request makes numpy build (and, for a fresh array,
 * allocate) a description of the array at every call. Nothing is allocated on success beyond a
 * fresh result, made by numpy without a Python call. Tensors go to shell_tensors.c. What is
 * taken is what the Python path (adapter/ops.py) would run as it is, without a copy: an exact
 * numpy array, C-contiguous and aligned, of a dtype of the group's table (native byte order,
 * bfloat16 included); out= an exact, writable array of the result's shape and dtype in memory
 * apart from x (or x itself where the result has x's shape). */
#include "shell_calls.h"

#include <string.h>

#include "shell_tensors.h"

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

int jl_shell_calls_ready(void) {
    /* looked up when the first group makes its shell: numpy is imported by then (importing the
     * engine alone does not import it) */
    return PyArray_API == NULL && _import_array() < 0 ? -1 : 0;
}

/* ---- what an array must be ---------------------------------------------------------------- */

/* The engine's dtype code of a numpy array (by its descriptor's identity), 0 when the fast path
 * does not take it: another byte order, a non-numeric type, an item size that is not the code's. */
static int dtype_of(Shell *self, PyArrayObject *arr) {
    PyObject *dtype = (PyObject *)PyArray_DESCR(arr);
    for (int i = 0; i < self->ndtypes; i++)
        if (self->dtypes[i] == dtype)
            return (size_t)PyArray_ITEMSIZE(arr) == jl_dtype_size(self->codes[i]) ? self->codes[i] : 0;
    return 0;
}

/* C-contiguous and aligned (the engine reads whole elements), writable where written. */
static int usable(PyArrayObject *arr, int writable) {
    int need = NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED | (writable ? NPY_ARRAY_WRITEABLE : 0);
    return (PyArray_FLAGS(arr) & need) == need;
}

static int has_shape(PyArrayObject *arr, int nd, const npy_intp *dims) {
    if (PyArray_NDIM(arr) != nd)
        return 0;
    const npy_intp *have = PyArray_DIMS(arr);
    for (int i = 0; i < nd; i++)
        if (have[i] != dims[i])
            return 0;
    return 1;
}

/* Whether two arrays' bytes do not overlap (empty ones never do, as the Python path counts). */
static int apart(PyArrayObject *a, PyArrayObject *b) {
    const char *p = PyArray_BYTES(a), *q = PyArray_BYTES(b);
    npy_intp m = PyArray_NBYTES(a), n = PyArray_NBYTES(b);
    return m == 0 || n == 0 || p + m <= q || q + n <= p;
}

/* An out= the fast path writes as it is: exact, of dtype `dtype` and shape (nd, dims), usable. */
static int takes_out(Shell *self, PyArrayObject *out, int dtype, int nd, const npy_intp *dims) {
    return dtype_of(self, out) == dtype && usable(out, 1) && has_shape(out, nd, dims);
}

/* A fresh C-contiguous base-class array of x's dtype and shape (nd, dims). */
static PyArrayObject *fresh(PyArrayObject *x, int nd, npy_intp *dims) {
    PyArray_Descr *descr = PyArray_DESCR(x);
    Py_INCREF(descr); /* NewFromDescr takes a reference to the descriptor */
    return (PyArrayObject *)PyArray_NewFromDescr(&PyArray_Type, descr, nd, dims, NULL, NULL, 0, NULL);
}

/* An integer argument in [0, limit), or -1 (a non-integer: the Python path says what is wrong). */
static int small_int(PyObject *arg, long limit) {
    int overflow;
    long v = PyLong_AsLongAndOverflow(arg, &overflow);
    if (v == -1 && PyErr_Occurred())
        PyErr_Clear();
    return overflow == 0 && v >= 0 && v < limit ? (int)v : -1;
}

static int arguments(const char *name, Py_ssize_t n, Py_ssize_t want) {
    if (n == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, n);
    return -1;
}

/* ---- all_reduce ----------------------------------------------------------------------------- */

/* all_reduce of numpy arrays: x exact, out x, None or an exact array. */
static PyObject *arrays_all_reduce(Shell *self, PyObject *x, PyObject *out, int op) {
    if (out != x && out != Py_None && !PyArray_CheckExact(out))
        Py_RETURN_NOTIMPLEMENTED;
    PyArrayObject *src = (PyArrayObject *)x;
    int dtype = dtype_of(self, src);
    if (dtype == 0 || !(self->reducible[dtype] >> op & 1) || !usable(src, out == x))
        Py_RETURN_NOTIMPLEMENTED;
    PyArrayObject *dst = src;
    if (out == Py_None) {
        if ((dst = fresh(src, PyArray_NDIM(src), PyArray_DIMS(src))) == NULL)
            return NULL;
    } else if (out != x) {
        dst = (PyArrayObject *)out;
        if (!takes_out(self, dst, dtype, PyArray_NDIM(src), PyArray_DIMS(src)) || !apart(src, dst))
            Py_RETURN_NOTIMPLEMENTED; /* the Python path refuses it, or finds it in place, and says so */
        Py_INCREF(dst);
    } else {
        Py_INCREF(dst);
    }
    Py_INCREF(src);
    size_t bytes = (size_t)PyArray_NBYTES(src);
    shell_call c = {SHELL_ALL_REDUCE, PyArray_DATA(src), PyArray_DATA(dst), bytes / jl_dtype_size(dtype), bytes, dtype,
                    op, 0};
    return jl_shell_run(self, &c, x, (PyObject *)dst);
}

PyObject *jl_shell_all_reduce(Shell *self, PyObject *const *args, Py_ssize_t n) {
    if (arguments("all_reduce", n, 3) < 0)
        return NULL;
    PyObject *x = args[0], *out = args[1];
    int op = small_int(args[2], JL_OPS);
    if (self->segment->ctx == NULL || op < 0)
        Py_RETURN_NOTIMPLEMENTED;
    if (PyArray_CheckExact(x))
        return arrays_all_reduce(self, x, out, op);
    int r = jl_tensors_is_tensor(&self->tensors, x);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    return jl_shell_tensor_all_reduce(self, x, out, op);
}

/* ---- reduce_scatter, all_gather, broadcast, barrier ---------------------------------------- */

/* The call for an x that is no numpy array: plain tensors' (shell_tensors.c), else the Python path's. */
static PyObject *tensor_call(Shell *self, int kind, PyObject *x, PyObject *out, int op, int32_t root) {
    int r = jl_tensors_is_tensor(&self->tensors, x);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    return jl_shell_tensor_collective(self, kind, x, out, op, root);
}

/* x as an input of a collective: an exact, usable array of a table dtype; its code, or 0. */
static int input(Shell *self, PyObject *x, int writable) {
    if (!PyArray_CheckExact(x) || !usable((PyArrayObject *)x, writable))
        return 0;
    return dtype_of(self, (PyArrayObject *)x);
}

/* The result of shape (nd, dims) of a collective of src (whose shape it is not): a fresh array
 * (out None), or out (an exact array) when the fast path writes it as it is (a new reference
 * either way). NULL with an exception set, or NULL without one when out is the Python path's. */
static PyArrayObject *result(Shell *self, PyArrayObject *src, PyObject *out, int dtype, int nd, npy_intp *dims) {
    if (out == Py_None)
        return fresh(src, nd, dims);
    PyArrayObject *dst = (PyArrayObject *)out;
    if (!takes_out(self, dst, dtype, nd, dims) || !apart(src, dst))
        return NULL;
    Py_INCREF(dst);
    return dst;
}

PyObject *jl_shell_reduce_scatter(Shell *self, PyObject *const *args, Py_ssize_t n) {
    if (arguments("reduce_scatter", n, 3) < 0)
        return NULL;
    PyObject *x = args[0], *out = args[1];
    int op = small_int(args[2], JL_OPS);
    jl_ctx *ctx = self->segment->ctx;
    if (ctx == NULL || op < 0)
        Py_RETURN_NOTIMPLEMENTED;
    if (!PyArray_CheckExact(x))
        return tensor_call(self, SHELL_REDUCE_SCATTER, x, out, op, 0);
    int dtype = input(self, x, 0);
    if (dtype == 0 || !(self->reducible[dtype] >> op & 1) || (out != Py_None && !PyArray_CheckExact(out)))
        Py_RETURN_NOTIMPLEMENTED;
    PyArrayObject *src = (PyArrayObject *)x, *dst;
    int nd = PyArray_NDIM(src);
    npy_intp size = jl_size(ctx), dims[NPY_MAXDIMS];
    if (nd == 0 || PyArray_DIMS(src)[0] % size != 0)
        Py_RETURN_NOTIMPLEMENTED; /* the Python path says the first axis must divide */
    memcpy(dims, PyArray_DIMS(src), (size_t)nd * sizeof dims[0]);
    dims[0] /= size;
    if ((dst = result(self, src, out, dtype, nd, dims)) == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_NotImplemented);
    shell_call c = {SHELL_REDUCE_SCATTER, PyArray_DATA(src), PyArray_DATA(dst), (size_t)PyArray_SIZE(dst),
                    (uint64_t)PyArray_NBYTES(src), dtype, op, 0};
    return jl_shell_run(self, &c, Py_NewRef(x), (PyObject *)dst);
}

PyObject *jl_shell_all_gather(Shell *self, PyObject *const *args, Py_ssize_t n) {
    if (arguments("all_gather", n, 2) < 0)
        return NULL;
    PyObject *x = args[0], *out = args[1];
    jl_ctx *ctx = self->segment->ctx;
    if (ctx == NULL)
        Py_RETURN_NOTIMPLEMENTED;
    if (!PyArray_CheckExact(x))
        return tensor_call(self, SHELL_ALL_GATHER, x, out, 0, 0);
    int dtype = input(self, x, 0);
    if (dtype == 0 || (out != Py_None && !PyArray_CheckExact(out)))
        Py_RETURN_NOTIMPLEMENTED;
    PyArrayObject *src = (PyArrayObject *)x, *dst;
    int nd = PyArray_NDIM(src);
    npy_intp dims[NPY_MAXDIMS];
    if (nd == 0) { /* a scalar counts as shape (1,) */
        nd = 1;
        dims[0] = 1;
    } else {
        memcpy(dims, PyArray_DIMS(src), (size_t)nd * sizeof dims[0]);
    }
    dims[0] *= jl_size(ctx);
    if ((dst = result(self, src, out, dtype, nd, dims)) == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_NotImplemented);
    shell_call c = {SHELL_ALL_GATHER, PyArray_DATA(src), PyArray_DATA(dst), (size_t)PyArray_SIZE(src),
                    (uint64_t)PyArray_NBYTES(src), dtype, 0, 0};
    return jl_shell_run(self, &c, Py_NewRef(x), (PyObject *)dst);
}

PyObject *jl_shell_broadcast(Shell *self, PyObject *const *args, Py_ssize_t n) {
    if (arguments("broadcast", n, 3) < 0)
        return NULL;
    PyObject *x = args[0], *out = args[1];
    jl_ctx *ctx = self->segment->ctx;
    int root = ctx == NULL ? -1 : small_int(args[2], jl_size(ctx));
    if (root < 0)
        Py_RETURN_NOTIMPLEMENTED; /* a root out of range: the Python path says so */
    if (!PyArray_CheckExact(x))
        return tensor_call(self, SHELL_BROADCAST, x, out, 0, root);
    int dtype = input(self, x, out == x);
    if (dtype == 0 || (out != Py_None && !PyArray_CheckExact(out)))
        Py_RETURN_NOTIMPLEMENTED;
    PyArrayObject *src = (PyArrayObject *)x, *dst = src;
    int is_root = jl_member(ctx) == root; /* the whole group's segment: members are its ranks */
    if (out == Py_None) {
        if ((dst = fresh(src, PyArray_NDIM(src), PyArray_DIMS(src))) == NULL)
            return NULL;
        if (is_root)
            memcpy(PyArray_DATA(dst), PyArray_DATA(src), (size_t)PyArray_NBYTES(src));
    } else if (out != x) {
        dst = (PyArrayObject *)out;
        int same = PyArray_BYTES(dst) == PyArray_BYTES(src) && PyArray_NBYTES(dst) == PyArray_NBYTES(src);
        if (!takes_out(self, dst, dtype, PyArray_NDIM(src), PyArray_DIMS(src)) || !(same || apart(src, dst)))
            Py_RETURN_NOTIMPLEMENTED;
        if (is_root && !same) /* as the Python path: the root's x into out=, then out= is sent */
            memcpy(PyArray_DATA(dst), PyArray_DATA(src), (size_t)PyArray_NBYTES(src));
        Py_INCREF(dst);
    } else {
        Py_INCREF(dst);
    }
    shell_call c = {SHELL_BROADCAST, PyArray_DATA(dst), PyArray_DATA(dst), (size_t)PyArray_SIZE(dst),
                    (uint64_t)PyArray_NBYTES(dst), dtype, 0, root};
    return jl_shell_run(self, &c, Py_NewRef(x), (PyObject *)dst);
}

PyObject *jl_shell_barrier(Shell *self, PyObject *const *args, Py_ssize_t n) {
    (void)args;
    if (arguments("barrier", n, 0) < 0)
        return NULL;
    if (self->segment->ctx == NULL)
        Py_RETURN_NOTIMPLEMENTED;
    shell_call c = {SHELL_BARRIER, NULL, NULL, 0, 0, 0, 0, 0};
    return jl_shell_run(self, &c, NULL, Py_NewRef(Py_None));
}
