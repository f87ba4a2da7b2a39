"""Marks the process group's operations opaque to Dynamo (torch.compile)."""
from __future__ import annotations

import functools
import sys
from typing import Any

import torch

# The operations torch calls on a process group. Dynamo (torch.compile) sees a process group as
# an opaque object: tracing into one of these Python methods fails at the first attribute it
# reads (torch.compile(DDP(model)) broke in the broadcast of DDP's bucket rebuild). Marked as
# disabled for Dynamo, they are called, not traced, as c10d's own C++ methods are. Importing
# torch._dynamo takes seconds, so torch.compiler.disable is applied only once Dynamo is loaded
# (it is whenever something is being compiled); until then the marked method calls straight on.
_OPERATIONS = (
    "allreduce", "allreduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
    "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "allgather", "allgather_coalesced",
    "all_gather_single", "_allgather_base", "all_gather_single_coalesced", "allgather_into_tensor_coalesced",
    "broadcast", "gather", "scatter", "alltoall", "all_to_all_single", "alltoall_base", "barrier",
    "monitored_barrier", "send", "recv", "recv_anysource", "shutdown", "abort",
)


def _opaque_to_dynamo(method: Any) -> Any:
    disabled: list = []

    @functools.wraps(method)
    def operation(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return method(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(method, recursive=True))
        return disabled[0](*args, **kwargs)
    operation._torchdynamo_disable = True  # Dynamo's mark: never inline this function
    return operation


def make_opaque(cls: type, names: tuple[str, ...]) -> None:
    """Replace each named method of cls by one Dynamo calls instead of tracing."""
    for name in names:
        setattr(cls, name, _opaque_to_dynamo(getattr(cls, name)))
