/* The fast path's collectives of plain torch CPU tensors (x exactly a torch.Tensor, which
 * tensors.c reads): each runs (jl_shell_run) what the Python path would run without a copy, or
 * returns NotImplemented before anything happened. */
#ifndef JL_SHELL_TENSORS_H
#define JL_SHELL_TENSORS_H

#include "shell_object.h"

/* all_reduce: out x, None or another tensor. A fresh result is taken for an x that requires
 * grad too (the result does not, as on the Python path); in place or into out= it is not (the
 * Python path decides what writing into it means). */
PyObject *jl_shell_tensor_all_reduce(Shell *self, PyObject *x, PyObject *out, int op);

/* reduce_scatter (op), all_gather or broadcast (root; out may be x): kind a SHELL_ collective. */
PyObject *jl_shell_tensor_collective(Shell *self, int kind, PyObject *x, PyObject *out, int op, int32_t root);

#endif
