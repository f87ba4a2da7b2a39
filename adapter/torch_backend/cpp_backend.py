"""Which process group torch gets: the C++ c10d Backend (csrc/torch/) or the Python one.

JACKLRING_TORCH_NATIVE chooses: auto (the default) the C++ Backend where the group's ranks share
memory and its cached build loads (native.py), else the Python group (one warning line says why
when the build does not load); 1 the C++ Backend whenever its build loads, else the Python group
with one warning naming why; 0 the Python group. Where the group's ranks all share one segment of
the shared-memory engine, the C++ Backend runs the collectives it covers itself (all-reduce,
all-gather, reduce-scatter, broadcast, barrier: csrc/torch/native_ops.cpp); everything else it
hands to the Python group (docs/torch.md, "The C++ Backend").

Either way the Python JacklringProcessGroup exists: the C++ Backend delegates to it what it does
not run itself, in issue order on the same executors.
"""
from __future__ import annotations

import logging
from typing import Any

from .. import config

log = logging.getLogger("jacklring.torch")

_warned: set[str] = set()


def _say_once(level: int, why: str) -> None:
    if why not in _warned:
        _warned.add(why)
        log.log(level, "jacklring: %s; the torch process group runs in Python", why)


# The engine's reductions (csrc/shm/engine.h jl_op) by code, as the Python path names them.
ENGINE_OP_NAMES = ("SUM", "PRODUCT", "MAX", "MIN", "BAND", "BOR", "BXOR")


def choose(group: Any) -> Any:
    """What the creator hands torch for the Python process group `group`: the group itself or a
    process group over a C++ Backend delegating to it (and running the collectives it covers
    natively where the group shares memory)."""
    setting = config.get("JACKLRING_TORCH_NATIVE")
    segment = group.shared_memory()
    if setting == "0" or (setting == "auto" and segment is None):
        return group  # auto: with nothing shared the C++ Backend would only hand everything over
    from . import native

    module, why = native.load()
    if module is None:
        _say_once(logging.WARNING, why)
        return group
    backend = module.JacklringBackend(group.rank(), group.size(), group)
    if segment is not None:
        _enable_native(backend, segment, group.timeout_s)
    return _named(module, backend)


def _named(module: Any, backend: Any) -> Any:
    """torch's process group over `backend`, named "jacklring": torch would otherwise wrap it in a
    group whose C++ name is "custom" (what DDP's logging data reports)."""
    import torch
    from torch.distributed import ProcessGroup

    pg = module.NamedProcessGroup(backend.rank(), backend.size())
    pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.CUSTOM, backend)
    pg._set_default_backend(ProcessGroup.BackendType.CUSTOM)
    return pg


def _enable_native(backend: Any, segment: Any, timeout_s: float) -> None:
    """Hand the C++ Backend the engine's function table, the segment's context and the ring's
    header codes (the same headers as the Python path: a mismatch is found either way)."""
    from ..backends.local import _engine
    from ..backends.local.segment import OP_CODES
    from ..backends.protocol import REDUCE_CODES
    from ..backends.ring import header

    by_engine_code = {code: op for op, code in OP_CODES.items()}
    reduce = [REDUCE_CODES[by_engine_code[code]] for code in range(len(ENGINE_OP_NAMES))]
    ops = [header.OP_ALL_REDUCE, header.OP_ALL_GATHER, header.OP_REDUCE_SCATTER, header.OP_BROADCAST,
           header.OP_BARRIER]
    backend.enable_native(_engine.API, segment.context(), segment, timeout_s, header.HEADER_MAGIC, ops, reduce)


def python_group(pg: Any, group_class: type) -> Any:
    """The Python group (of `group_class`, JacklringProcessGroup, passed in so that this module
    never imports process_group.py back) behind a torch process group: itself, or the delegate of
    its C++ Backend; None for any other group."""
    if isinstance(pg, group_class):
        return pg
    try:
        import torch

        backend = pg._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError, ValueError):
        return None
    delegate = getattr(backend, "delegate", None)
    return delegate if isinstance(delegate, group_class) else None


FLOOR_NAME = "jacklring_floor"


def register_floor() -> str:
    """Register the torch backend "jacklring_floor": the do-nothing C++ Backend of the cached
    build, torch's own cost per call (adapter.bench's torch-floor column). "" once registered,
    else why it cannot be."""
    from . import native

    module, why = native.load()
    if module is None:
        return why
    import torch.distributed as dist

    if FLOOR_NAME.upper() not in dist.Backend._plugins:
        def create(common: Any, _options: Any) -> Any:
            return module.FloorBackend(int(common.group_rank), int(common.group_size))
        dist.Backend.register_backend(FLOOR_NAME, create, extended_api=True, devices=["cpu"])
    return ""
