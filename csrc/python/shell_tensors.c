/* See shell_tensors.h. What a tensor must be is tensors.c's (jl_tensors_view); the rest mirrors
 * the arrays' checks in shell_calls.c: an out= of the result's dtype and shape in memory apart
 * from x (or x itself where the result has x's shape), else the Python path. */
#include "shell_tensors.h"

#include <string.h>

static PyObject *not_taken(int r) {
    return r < 0 ? NULL : Py_NewRef(Py_NotImplemented);
}

static int apart(const jl_tensor_view *a, const jl_tensor_view *b) {
    return a->data + a->nbytes <= b->data || b->data + b->nbytes <= a->data;
}

/* out as the result of x's collective, written as it is: a plain tensor of x's dtype whose shape
 * equals `shape`, apart from x (or, with same_ok, covering x's very bytes: *same set). 1 with
 * *dst filled, 0 when the Python path takes the call, -1 with an exception set. */
static int takes_out(Shell *self, PyObject *out, const jl_tensor_view *src, PyObject *shape, int same_ok,
                     jl_tensor_view *dst, int *same) {
    int r = jl_tensors_is_tensor(&self->tensors, out);
    if (r > 0)
        r = jl_tensors_view(&self->tensors, out, 0, dst);
    if (r <= 0)
        return r;
    *same = dst->data == src->data && dst->nbytes == src->nbytes;
    if (dst->dtype != src->dtype || !(apart(src, dst) || (same_ok && *same)))
        return 0;
    PyObject *have = jl_tensors_shape(out);
    if (have == NULL || (r = PyObject_RichCompareBool(have, shape, Py_EQ)) < 0) {
        Py_XDECREF(have);
        PyErr_Clear(); /* the Python path reads the shape again and words what failed */
        return 0;
    }
    Py_DECREF(have);
    return r;
}

/* The result's shape: x's (broadcast), times the group's size along the first axis, a scalar
 * counting as (1,) (all_gather), or divided by it (reduce_scatter). A new reference; NULL with
 * no exception when the Python path takes the call (a first axis the size does not divide). */
static PyObject *result_shape(int kind, PyObject *x, Py_ssize_t size) {
    PyObject *shape = jl_tensors_shape(x);
    if (shape == NULL || kind == SHELL_BROADCAST)
        return shape;
    if (!PyTuple_Check(shape)) { /* a torch.Size is a tuple; anything else is the Python path's */
        Py_DECREF(shape);
        return NULL;
    }
    Py_ssize_t nd = PyTuple_GET_SIZE(shape);
    Py_ssize_t first = nd == 0 ? 1 : PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, 0));
    PyObject *made = NULL;
    if (first < 0 || (kind == SHELL_REDUCE_SCATTER && (nd == 0 || first % size != 0)))
        goto done;
    made = PyTuple_New(nd == 0 ? 1 : nd);
    if (made == NULL)
        goto done;
    PyObject *lead = PyLong_FromSsize_t(kind == SHELL_REDUCE_SCATTER ? first / size : first * size);
    if (lead == NULL) {
        Py_CLEAR(made);
        goto done;
    }
    PyTuple_SET_ITEM(made, 0, lead);
    for (Py_ssize_t i = 1; i < nd; i++)
        PyTuple_SET_ITEM(made, i, Py_NewRef(PyTuple_GET_ITEM(shape, i)));
done:
    Py_DECREF(shape);
    if (made == NULL && !PyErr_ExceptionMatches(PyExc_MemoryError))
        PyErr_Clear();
    return made;
}

PyObject *jl_shell_tensor_all_reduce(Shell *self, PyObject *x, PyObject *out, int op) {
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
    shell_call c = {SHELL_ALL_REDUCE, src.data, dst.data, src.nbytes / jl_dtype_size(src.dtype), src.nbytes, src.dtype,
                    op, 0};
    return jl_shell_run(self, &c, Py_NewRef(x), result);
}

PyObject *jl_shell_tensor_collective(Shell *self, int kind, PyObject *x, PyObject *out, int op, int32_t root) {
    jl_tensor_view src, dst;
    int r = jl_tensors_view(&self->tensors, x, out == Py_None, &src);
    if (r <= 0)
        return not_taken(r);
    if (kind == SHELL_REDUCE_SCATTER && !(self->reducible[src.dtype] >> op & 1))
        Py_RETURN_NOTIMPLEMENTED;
    int32_t size = jl_size(self->segment->ctx);
    int is_root = jl_member(self->segment->ctx) == root, same = 0;
    PyObject *shape = result_shape(kind, x, size), *result;
    if (shape == NULL) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_MemoryError))
            PyErr_Clear(); /* the Python path reads the shape again and words what failed */
        return not_taken(PyErr_Occurred() ? -1 : 0);
    }
    if (out == Py_None) {
        result = jl_tensors_new_empty(x, shape, &dst.data);
        dst.nbytes = src.nbytes / (kind == SHELL_REDUCE_SCATTER ? (size_t)size : 1) *
                     (kind == SHELL_ALL_GATHER ? (size_t)size : 1);
    } else if (out == x && kind == SHELL_BROADCAST) {
        dst = src;
        same = 1;
        result = Py_NewRef(out);
    } else {
        r = takes_out(self, out, &src, shape, kind == SHELL_BROADCAST, &dst, &same);
        result = r > 0 ? Py_NewRef(out) : NULL;
    }
    Py_DECREF(shape);
    if (result == NULL)
        return not_taken(PyErr_Occurred() ? -1 : 0);
    if (kind == SHELL_BROADCAST && is_root && !same) /* as the Python path: x into the result, then sent */
        memcpy(dst.data, src.data, src.nbytes);
    size_t item = jl_dtype_size(src.dtype);
    shell_call c = {kind, src.data, dst.data, (kind == SHELL_REDUCE_SCATTER ? dst.nbytes : src.nbytes) / item,
                    src.nbytes, src.dtype, op, root};
    if (kind == SHELL_BROADCAST)
        c.src = dst.data;
    return jl_shell_run(self, &c, Py_NewRef(x), result);
}
