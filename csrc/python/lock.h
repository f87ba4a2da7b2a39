/* The binding's Lock (lock.c): one collective at a time, for the Python paths and the fast path. */
#ifndef JL_LOCK_H
#define JL_LOCK_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    int held; /* read and written with the GIL held */
} Lock;

extern PyTypeObject LockType;

/* Take the lock (the GIL released while blocked): 1 taken, 0 not (only when !blocking), -1 a
 * signal handler raised. With the GIL held. */
int jl_lock_take(Lock *self, int blocking);
/* Release a lock this thread took. With the GIL held. */
void jl_lock_give(Lock *self);
/* Add the Lock type to the module: 0, or -1 with an exception set. */
int jl_lock_add_type(PyObject *module);

#endif
