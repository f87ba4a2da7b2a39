/* See tensors.h. Each check is one attribute read or method call on the tensor (tens of
 * nanoseconds in torch); the checks are the ones adapter/arrays.py's call_view makes, so a
 * tensor this path takes is one the Python path would reduce through its numpy view. */
#include "tensors.h"

#include <stdint.h>

#include "../shm/engine.h"

#define CODE_COMPLEX64 14  /* adapter/backends/elements.py DTYPE_CODES: the two complex dtypes, */
#define CODE_COMPLEX128 15 /* the only ones a lazy conjugation can mark */

static PyObject *is_cpu_name, *layout_name, *is_nested_name, *requires_grad_name, *dtype_name, *is_contiguous_name,
    *is_neg_name, *is_conj_name, *numel_name, *data_ptr_name, *shape_name, *new_empty_name;

static int intern(PyObject **name, const char *text) {
    if (*name == NULL)
        *name = PyUnicode_InternFromString(text);
    return *name == NULL ? -1 : 0;
}

int jl_tensors_init(jl_tensors *t, PyObject *lookup) {
    if (intern(&is_cpu_name, "is_cpu") < 0 || intern(&layout_name, "layout") < 0 ||
        intern(&is_nested_name, "is_nested") < 0 || intern(&requires_grad_name, "requires_grad") < 0 ||
        intern(&dtype_name, "dtype") < 0 || intern(&is_contiguous_name, "is_contiguous") < 0 ||
        intern(&is_neg_name, "is_neg") < 0 || intern(&is_conj_name, "is_conj") < 0 ||
        intern(&numel_name, "numel") < 0 || intern(&data_ptr_name, "data_ptr") < 0 ||
        intern(&shape_name, "shape") < 0 || intern(&new_empty_name, "new_empty") < 0)
        return -1;
    jl_tensors_clear(t);
    if (lookup != Py_None) {
        Py_INCREF(lookup);
        t->lookup = lookup;
    }
    return 0;
}

void jl_tensors_clear(jl_tensors *t) {
    for (int i = 0; i < t->ndtypes; i++)
        Py_CLEAR(t->dtypes[i]);
    t->ndtypes = 0;
    Py_CLEAR(t->lookup);
    Py_CLEAR(t->type);
    Py_CLEAR(t->empty_like);
    Py_CLEAR(t->strided);
}

/* lookup()'s table, once torch is imported: 1 found, 0 not yet, -1 with an exception set. */
static int look_up(jl_tensors *t) {
    PyObject *found = PyObject_CallNoArgs(t->lookup);
    if (found == NULL || found == Py_None) {
        Py_XDECREF(found);
        return found == NULL ? -1 : 0;
    }
    PyObject *type, *pairs, *empty_like, *strided, *fast = NULL;
    if (!PyArg_ParseTuple(found, "O!OOO", &PyType_Type, &type, &pairs, &empty_like, &strided) ||
        (fast = PySequence_Fast(pairs, "tensor dtypes")) == NULL)
        goto bad;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > JL_TENSOR_DTYPES) {
        PyErr_Format(PyExc_ValueError, "tensor dtypes: at most %d", JL_TENSOR_DTYPES);
        goto bad;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *dtype;
        int code;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "Oi", &dtype, &code))
            goto bad;
        if (code <= 0 || code >= JL_TENSOR_DTYPES || jl_dtype_size(code) == 0) {
            PyErr_Format(PyExc_ValueError, "tensor dtypes: unknown code %d", code);
            goto bad;
        }
        Py_INCREF(dtype);
        t->dtypes[t->ndtypes] = dtype;
        t->codes[t->ndtypes++] = code;
    }
    Py_INCREF(empty_like);
    t->empty_like = empty_like;
    Py_INCREF(strided);
    t->strided = strided;
    Py_INCREF(type);
    t->type = type; /* last: a table without it is not used */
    Py_DECREF(fast);
    Py_DECREF(found);
    return 1;
bad:
    Py_XDECREF(fast);
    Py_DECREF(found);
    for (int i = 0; i < t->ndtypes; i++)
        Py_CLEAR(t->dtypes[i]);
    t->ndtypes = 0;
    return -1;
}

int jl_tensors_is_tensor(jl_tensors *t, PyObject *x) {
    if (t->type == NULL) {
        if (t->lookup == NULL)
            return 0;
        int r = look_up(t);
        if (r <= 0)
            return r;
    }
    return Py_TYPE(x) == (PyTypeObject *)t->type;
}

/* A boolean attribute (call: a method without arguments): 1, 0, or -1 with an exception set. */
static int flag(PyObject *x, PyObject *name, int call) {
    PyObject *v = call ? PyObject_CallMethodNoArgs(x, name) : PyObject_GetAttr(x, name);
    if (v == NULL)
        return -1;
    int r = v == Py_True ? 1 : v == Py_False ? 0 : PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* The engine's code of x's dtype, 0 when not in the table, -1 with an exception set. */
static int code_of(jl_tensors *t, PyObject *x) {
    PyObject *dtype = PyObject_GetAttr(x, dtype_name);
    if (dtype == NULL)
        return -1;
    int code = 0;
    for (int i = 0; i < t->ndtypes && code == 0; i++)
        if (t->dtypes[i] == dtype)
            code = t->codes[i];
    Py_DECREF(dtype); /* the table holds every dtype it compares to */
    return code;
}

/* An integer method's value (numel, data_ptr) as a pointer-sized unsigned; -1 with an exception. */
static int count(PyObject *x, PyObject *name, size_t *out) {
    PyObject *v = PyObject_CallMethodNoArgs(x, name);
    if (v == NULL)
        return -1;
    *out = (size_t)PyLong_AsVoidPtr(v);
    Py_DECREF(v);
    return PyErr_Occurred() ? -1 : 0;
}

int jl_tensors_view(jl_tensors *t, PyObject *x, int grad_ok, jl_tensor_view *v) {
    int code = 0;
    size_t numel = 0, data = 0;
    if (flag(x, is_cpu_name, 0) != 1)
        goto refused;
    PyObject *layout = PyObject_GetAttr(x, layout_name);
    if (layout == NULL)
        goto refused;
    int strided = layout == t->strided;
    Py_DECREF(layout);
    if (!strided || flag(x, is_nested_name, 0) != 0 || (!grad_ok && flag(x, requires_grad_name, 0) != 0) ||
        (code = code_of(t, x)) <= 0 || flag(x, is_contiguous_name, 1) != 1 || flag(x, is_neg_name, 1) != 0 ||
        ((code == CODE_COMPLEX64 || code == CODE_COMPLEX128) && flag(x, is_conj_name, 1) != 0) ||
        count(x, numel_name, &numel) < 0 || count(x, data_ptr_name, &data) < 0)
        goto refused;
    size_t size = jl_dtype_size(code);
    /* empty: nothing to reduce, the Python path returns it; misaligned: the engine reads whole
     * elements (a dtype view at an odd offset) */
    if (numel == 0 || data % size != 0 || numel > SIZE_MAX / size)
        goto refused;
    v->data = (char *)(uintptr_t)data;
    v->nbytes = numel * size;
    v->dtype = code;
    return 1;
refused:
    if (PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError))
            return -1;
        PyErr_Clear(); /* an attribute that raised: the Python path reads it again and words it */
    }
    return 0;
}

int jl_tensors_same_shape(PyObject *a, PyObject *b) {
    PyObject *sa = PyObject_GetAttr(a, shape_name);
    if (sa == NULL)
        return -1;
    PyObject *sb = PyObject_GetAttr(b, shape_name);
    if (sb == NULL) {
        Py_DECREF(sa);
        return -1;
    }
    int r = PyObject_RichCompareBool(sa, sb, Py_EQ);
    Py_DECREF(sa);
    Py_DECREF(sb);
    return r;
}

PyObject *jl_tensors_shape(PyObject *x) {
    return PyObject_GetAttr(x, shape_name);
}

/* result and its data pointer, or NULL (result released) with an exception set. */
static PyObject *with_data(PyObject *result, char **data) {
    size_t at = 0;
    if (result == NULL)
        return NULL;
    if (count(result, data_ptr_name, &at) < 0) {
        Py_DECREF(result);
        return NULL;
    }
    *data = (char *)(uintptr_t)at;
    return result;
}

PyObject *jl_tensors_new_empty(PyObject *x, PyObject *shape, char **data) {
    return with_data(PyObject_CallMethodOneArg(x, new_empty_name, shape), data);
}

PyObject *jl_tensors_empty_like(jl_tensors *t, PyObject *x, char **data) {
    return with_data(PyObject_CallOneArg(t->empty_like, x), data);
}
