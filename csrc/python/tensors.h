/* Plain torch CPU tensors for the fast path (shell.c), read through their Python attributes:
 * the engine's module builds and runs without torch, so torch's C++ API is not linked in. */
#ifndef JL_TENSORS_H
#define JL_TENSORS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

#define JL_TENSOR_DTYPES 16

typedef struct {
    PyObject *lookup;     /* lookup(): None until torch is imported, then (Tensor, pairs, empty_like, strided) */
    PyObject *type;       /* torch.Tensor, NULL until lookup() found it */
    PyObject *empty_like; /* torch.empty_like */
    PyObject *strided;    /* torch.strided: the only layout taken */
    PyObject *dtypes[JL_TENSOR_DTYPES]; /* torch dtypes (one object per dtype: found by identity) */
    int codes[JL_TENSOR_DTYPES];        /* and the engine's code of each */
    int ndtypes;
} jl_tensors;

/* One tensor's memory as the engine reads it. */
typedef struct {
    char *data;
    size_t nbytes;
    int dtype;
} jl_tensor_view;

/* Set up with lookup (kept). 0, or -1 with an exception set. The names are interned once. */
int jl_tensors_init(jl_tensors *t, PyObject *lookup);
void jl_tensors_clear(jl_tensors *t);

/* Whether x is exactly a torch.Tensor (no subclass: a Parameter, a fake or traced tensor go to
 * the Python path). Looks torch up while it is not known. 1, 0, or -1 with an exception set. */
int jl_tensors_is_tensor(jl_tensors *t, PyObject *x);

/* x (a torch.Tensor) as the fast path takes it: on the CPU, strided and contiguous, not nested,
 * no lazy negation or conjugation, a dtype of the table, aligned; not requiring grad unless
 * grad_ok. 1 with *v filled, 0 when the fast path does not take it (no exception set: an
 * attribute that raised is left to the Python path, which words it), -1 on a failed
 * allocation. */
int jl_tensors_view(jl_tensors *t, PyObject *x, int grad_ok, jl_tensor_view *v);

/* Whether two tensors have the same shape. 1, 0, or -1 with an exception set. */
int jl_tensors_same_shape(PyObject *a, PyObject *b);

/* x.shape (a torch.Size, a tuple): a new reference, or NULL with an exception set. */
PyObject *jl_tensors_shape(PyObject *x);

/* x.new_empty(shape) and its data pointer: a contiguous tensor of x's dtype and device that
 * does not require grad. NULL with an exception set. */
PyObject *jl_tensors_new_empty(PyObject *x, PyObject *shape, char **data);

/* torch.empty_like(x) and its data pointer: a contiguous CPU tensor of x's shape and dtype
 * (x contiguous: its strides are kept) that does not require grad. NULL with an exception set. */
PyObject *jl_tensors_empty_like(jl_tensors *t, PyObject *x, char **data);

#endif
