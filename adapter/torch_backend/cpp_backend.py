"""Which process group torch gets: the C++ c10d Backend (csrc/torch/) or the Python one.

JACKLRING_TORCH_NATIVE chooses: 0 always the Python group (today's path, for comparison and
bisecting); 1 the C++ Backend whenever its cached build loads (native.py), else the Python
group with one warning naming why; auto (the default) the C++ Backend only where it has a
native fast path to offer. Where it does not, every operation of the C++ Backend is handed to
the Python group, which then costs a C++ -> Python hop more than the Python group alone, so
auto stays on the Python group. In this version the native path is not wired yet (the
engine's context is not exported), so auto means the Python group.

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


def native_fast_path_available(group: Any) -> bool:
    """Whether the C++ Backend can run this group's collectives natively (a same-host group on
    the shared-memory engine's C interface). Not wired in this version: see the docstring."""
    return False


def choose(group: Any) -> Any:
    """What the creator hands torch for the Python process group `group`: the group itself or a
    C++ Backend delegating to it."""
    mode = config.get("JACKLRING_TORCH_NATIVE")
    if mode == "0" or (mode == "auto" and not native_fast_path_available(group)):
        return group
    from . import native

    module, why = native.load()
    if module is None:
        _say_once(logging.WARNING if mode == "1" else logging.INFO, why)
        return group
    return module.JacklringBackend(group.rank(), group.size(), group)


def python_group(pg: Any) -> Any:
    """The Python JacklringProcessGroup behind a torch process group (itself, or the delegate of
    its C++ Backend); None for any other group."""
    from .process_group import JacklringProcessGroup

    if isinstance(pg, JacklringProcessGroup):
        return pg
    try:
        import torch

        backend = pg._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError, ValueError):
        return None
    delegate = getattr(backend, "delegate", None)
    return delegate if isinstance(delegate, JacklringProcessGroup) else None


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
