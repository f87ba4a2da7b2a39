"""Works that Python code hands to torch's C++ and C++ keeps after Python has let go.

A JacklringWork is a Python subclass of torch's Work: its wait() and get_future() live in the
Python object, and C++ reaches them through pybind11's trampoline only while that object is
alive. When C++ takes a Work from a C++ call (DDP's bucket all-reduces) torch wraps it in a
holder that keeps the Python object alive; when Python passes one in, nothing does. DDP's
`join()` does exactly that: the forward pass's all-reduce (`Join.notify_join_context`) goes to
`Reducer._set_forward_pass_work_handle`, the Python Work is freed once DDP's local variable
goes, and in backward the reducer calls wait() (torch's base Work::wait, which never returns:
the training hangs) and getFuture() ("Work::getFuture not implemented"). gloo's Works are C++
objects and have no such half.

The fix hands the reducer a C++ Work over the same future (torch's `_create_work_from_future`):
its wait() waits for the future and raises its error, getFuture() returns it, and it lives
exactly as long as the reducer keeps it.
"""
from __future__ import annotations

from typing import Any

_installed = False


def install() -> None:
    """Wrap Reducer._set_forward_pass_work_handle (idempotent)."""
    global _installed
    if _installed:
        return
    from torch._C._distributed_c10d import Reducer, _create_work_from_future

    from .work import JacklringWork

    original = Reducer._set_forward_pass_work_handle

    def _set_forward_pass_work_handle(reducer: Any, work: Any, use_static_world_size: bool) -> None:
        if isinstance(work, JacklringWork):
            work = _create_work_from_future(work.get_future())
        original(reducer, work, use_static_world_size)

    _set_forward_pass_work_handle.__doc__ = original.__doc__
    Reducer._set_forward_pass_work_handle = _set_forward_pass_work_handle
    _installed = True
