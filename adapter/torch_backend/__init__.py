"""The torch.distributed backend "jacklring": registration and the creator torch calls.

    import torch
    import adapter.torch_backend        # registers (so does `import torch` when jacklring is pip-installed)
    torch.distributed.init_process_group("jacklring")

This module imports nothing from torch at import time: torch's plugin loader calls
autoload() while `import torch` is still running, and the process group class (which
subclasses torch.distributed.ProcessGroup) is imported only when a group is created.
"""
from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .rendezvous import JacklringOptions

log = logging.getLogger("jacklring.torch")

BACKEND_NAME = "jacklring"
DEVICES = ["cpu", "cuda"]  # CUDA tensors are staged through host memory

_registered = False


def register_backend() -> bool:
    """Register "jacklring" with torch.distributed (idempotent). False when torch has no
    distributed support."""
    global _registered
    if _registered:
        return True
    import torch.distributed as dist

    if not dist.is_available():
        return False
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create_process_group, extended_api=True, devices=DEVICES)
    # Nothing else: torch imports this in every program of the environment (gloo's too), so
    # registering never touches the environment, starts a thread or opens a socket.
    _registered = True
    return True


def fill_torch_env() -> dict[str, str]:
    """Under plain srun, mpirun or mlx.launch (no RANK/WORLD_SIZE), set RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR and MASTER_PORT from Slurm's, MPI's or MLX's variables (LOCAL_RANK
    not from MLX's, which do not tell it), never overriding one that is
    set, so that init_process_group("jacklring") with torch's default env:// finds them. Call it
    before init_process_group; returns what it set. Registration never does this on its own."""
    from . import rendezvous

    return rendezvous.fill_torch_env()


def autoload() -> None:
    """Entry point of the "torch.backends" plugin group: torch calls it during `import torch`,
    after torch.distributed is imported. It registers the backend and does nothing else (no
    environment variables, threads or sockets); it must be cheap and must never raise (an
    exception here would break `import torch` for every program in the environment)."""
    try:
        if "torch.distributed" in sys.modules:
            register_backend()
    except Exception as exc:  # pragma: no cover - defensive: never break `import torch`
        log.debug("jacklring: could not register the torch backend: %s", exc)


def _create_process_group(common: Any, pg_options: Any) -> Any:
    """torch's creator (extended API): common carries store, group_rank, group_size, timeout,
    group_id and global_ranks_in_group; pg_options is what the user passed to
    init_process_group / new_group."""
    from . import cpp_backend
    from .pairing import check_pairing, device_backends
    from .process_group import JacklringProcessGroup
    from .rendezvous import backend_choice, create_backend, deadline_seconds

    rank, size = int(common.group_rank), int(common.group_size)
    check_pairing(rank, device_backends(), BACKEND_NAME)  # "cpu:jacklring,cuda:nccl": torch never builds the nccl half
    timeout_s = deadline_seconds(common.timeout)
    choice = backend_choice(pg_options)
    is_default = not list(common.global_ranks_in_group or [])
    group_id = str(common.group_id or "")
    comm, origin = create_backend(common.store, rank, size, timeout_s, choice, is_default, group_id)
    from .barrier_route import route_on_first_group

    route_on_first_group(route_monitored_barrier)  # dist.monitored_barrier answers on this group
    group = JacklringProcessGroup(common.store, rank, size, comm, timeout_s, group_id=group_id, rendezvous=origin)
    return cpp_backend.choose(group)  # the group itself, or the C++ Backend over it


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """torch.distributed.monitored_barrier for jacklring groups (torch offers it on gloo only):
    rank 0 waits for every rank until `timeout` (timedelta or seconds; default the group's
    deadline) and raises naming the first group rank that did not arrive, or all of them with
    wait_all_ranks=True; the other ranks raise when rank 0 does not release them in time.
    Groups of other backends are handed to torch's own monitored_barrier."""
    import torch.distributed as dist

    from .cpp_backend import python_group
    from .process_group import JacklringProcessGroup

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    jacklring_group = python_group(pg, JacklringProcessGroup)  # the group itself, or the Python group behind its C++ Backend
    if jacklring_group is not None:
        jacklring_group.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
    else:
        torch_own = _torch_monitored_barrier or dist.monitored_barrier
        torch_own(group=pg, timeout=timeout, wait_all_ranks=wait_all_ranks)


_torch_monitored_barrier: Any = None  # torch's own function, once route_monitored_barrier() replaced it


def route_monitored_barrier() -> None:
    """Make `torch.distributed.monitored_barrier` run monitored_barrier() above on jacklring
    groups and torch's own on every other group (idempotent). For libraries that call
    `torch.distributed.monitored_barrier(...)` and cannot be changed; an explicit choice of the
    program, never done at import. A library that did `from torch.distributed import
    monitored_barrier` before this call keeps torch's function. Done on its own when the first
    jacklring process group forms, unless JACKLRING_TORCH_MONITORED_BARRIER=0
    (barrier_route.py)."""
    global _torch_monitored_barrier
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if _torch_monitored_barrier is not None:
        return
    _torch_monitored_barrier = distributed_c10d.monitored_barrier

    def routed(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        monitored_barrier(group, timeout, wait_all_ranks)

    routed.__doc__ = monitored_barrier.__doc__
    dist.monitored_barrier = routed
    distributed_c10d.monitored_barrier = routed  # the module torch.distributed re-exports it from


__all__ = ["register_backend", "autoload", "fill_torch_env", "monitored_barrier", "route_monitored_barrier",
           "BACKEND_NAME", "JacklringOptions"]

# Importing this module registers the backend when torch.distributed is already loaded.
autoload()


def __getattr__(name: str) -> Any:
    """JacklringOptions loads with the rendezvous it configures, when first asked for: torch's
    plugin loader imports this module in every program, and registering needs neither."""
    if name == "JacklringOptions":
        from .rendezvous import JacklringOptions

        return JacklringOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
