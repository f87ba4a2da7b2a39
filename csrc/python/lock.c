/* adapter.backends.local._engine.Lock: the lock every path of a group takes to run one
 * collective at a time (the Python paths through acquire/release, as they took a
 * threading.Lock; the fast path, shell.c, in C). Blocked, it waits without the GIL; a signal
 * handler that raises ends the wait, as threading.Lock's does. */
#include "lock.h"

/* Take the lock: 1 taken, 0 not (only when !blocking), -1 a signal handler raised. */
int jl_lock_take(Lock *self, int blocking) {
    if (PyThread_acquire_lock_timed(self->lock, 0, 0) != PY_LOCK_ACQUIRED) {
        if (!blocking)
            return 0;
        for (;;) {
            PyLockStatus r;
            Py_BEGIN_ALLOW_THREADS
            r = PyThread_acquire_lock_timed(self->lock, -1, 1);
            Py_END_ALLOW_THREADS
            if (r == PY_LOCK_ACQUIRED)
                break;
            if (Py_MakePendingCalls() < 0) /* PY_LOCK_INTR: run the handlers, as threading.Lock */
                return -1;
        }
    }
    self->held = 1;
    return 1;
}

void jl_lock_give(Lock *self) {
    self->held = 0;
    PyThread_release_lock(self->lock);
}

static PyObject *Lock_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "Lock() takes no arguments");
        return NULL;
    }
    Lock *self = (Lock *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->lock = PyThread_allocate_lock();
    if (self->lock == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void Lock_dealloc(Lock *self) {
    if (self->lock != NULL) {
        if (self->held)
            PyThread_release_lock(self->lock);
        PyThread_free_lock(self->lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Lock_acquire(Lock *self, PyObject *args, PyObject *kwargs) {
    int blocking = 1;
    static char *keywords[] = {"blocking", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|p", keywords, &blocking))
        return NULL;
    int r = jl_lock_take(self, blocking);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

static PyObject *Lock_release(Lock *self, PyObject *Py_UNUSED(unused)) {
    if (!self->held) {
        PyErr_SetString(PyExc_RuntimeError, "release unlocked lock");
        return NULL;
    }
    jl_lock_give(self);
    Py_RETURN_NONE;
}

static PyObject *Lock_exit(Lock *self, PyObject *Py_UNUSED(args)) {
    return Lock_release(self, NULL);
}

static PyObject *Lock_locked(Lock *self, PyObject *Py_UNUSED(unused)) {
    return PyBool_FromLong(self->held);
}

static PyMethodDef Lock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))Lock_acquire, METH_VARARGS | METH_KEYWORDS, "acquire(blocking=True) -> bool"},
    {"release", (PyCFunction)Lock_release, METH_NOARGS, "release()"},
    {"locked", (PyCFunction)Lock_locked, METH_NOARGS, "locked() -> bool"},
    {"__enter__", (PyCFunction)(void (*)(void))Lock_acquire, METH_VARARGS | METH_KEYWORDS, NULL},
    {"__exit__", (PyCFunction)Lock_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

PyTypeObject LockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "adapter.backends.local._engine.Lock",
    .tp_basicsize = sizeof(Lock),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One collective at a time: the lock a group's Python paths and its Shell share.",
    .tp_new = Lock_new,
    .tp_dealloc = (destructor)Lock_dealloc,
    .tp_methods = Lock_methods,
};

int jl_lock_add_type(PyObject *module) {
    if (PyType_Ready(&LockType) < 0)
        return -1;
    Py_INCREF(&LockType);
    if (PyModule_AddObject(module, "Lock", (PyObject *)&LockType) < 0) {
        Py_DECREF(&LockType);
        return -1;
    }
    return 0;
}
