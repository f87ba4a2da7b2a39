/* The fast path's collectives (Shell methods): each checks its arguments (numpy arrays here,
 * plain torch tensors in shell_tensors.c), and runs (jl_shell_run) what the Python path would run
 * without a copy, or returns NotImplemented before anything happened. */
#ifndef JL_SHELL_CALLS_H
#define JL_SHELL_CALLS_H

#include "shell_object.h"

/* numpy's C API, looked up once (numpy is imported by then). 0, or -1 with an exception set. */
int jl_shell_calls_ready(void);

/* all_reduce(x, out, op): out x, None (a fresh result) or a separate array or tensor. */
PyObject *jl_shell_all_reduce(Shell *self, PyObject *const *args, Py_ssize_t n);
/* reduce_scatter(x, out, op): this rank's block of the first axis, reduced. */
PyObject *jl_shell_reduce_scatter(Shell *self, PyObject *const *args, Py_ssize_t n);
/* all_gather(x, out): every rank's x along a new first-axis block, in rank order. */
PyObject *jl_shell_all_gather(Shell *self, PyObject *const *args, Py_ssize_t n);
/* broadcast(x, out, root): root's x; out x (in place), None or a separate array. */
PyObject *jl_shell_broadcast(Shell *self, PyObject *const *args, Py_ssize_t n);
/* barrier(): None. */
PyObject *jl_shell_barrier(Shell *self, PyObject *const *args, Py_ssize_t n);

#endif
