/* The binding's fast path for a group's whole collectives (shell.c): the Lock type that every
 * path of a group takes, and the Shell type that runs an all_reduce of numpy arrays in one call. */
#ifndef JL_SHELL_H
#define JL_SHELL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Add Lock and Shell to the module. 0, or -1 with an exception set. */
int jl_shell_add_types(PyObject *module);

#endif
