"""dist.shrink_group for jacklring process groups.

torch's own shrink_group asks the group's c10d Backend (`_get_backend(device)`) whether it
`supports_shrinking` and calls its `shrink()`; a Python process group has no c10d Backend, so
torch would fail with "Cannot access device backend for process group ...". This wraps
dist.shrink_group: for a jacklring group the survivors agree through the adapter backend's
shrink() (the ring's; the others raise saying what they lack), and the new process group is
registered in torch's world the way torch's own _finalize_shrunk_group does (torch's argument
checks and helpers, so the result behaves like a group torch shrank).

shrink_flags: with SHRINK_DEFAULT an operation of the old group still in flight on this rank
completes (if every rank it waits for finishes it) or fails when the agreement's decision breaks
the old group's links; with SHRINK_ABORT the links break before the agreement starts, so it fails
at once. Either way its Work completes, with an error naming the shrink, and never hangs; the
works queued behind it fail the same way when torch destroys the old group.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_installed = False
# torch's helpers that shrink_group is built from; all of them exist where shrink_group does (2.10+).
_HELPERS = ("_validate_shrink_inputs", "_prepare_shrink_target_group", "_validate_and_process_excluded_ranks",
            "_destroy_all_other_groups", "_extract_group_metadata", "_cleanup_original_group",
            "_register_pg_in_world", "_update_default_pg")


def install(group_type: type, resolve: Callable[[Any], Any] | None = None) -> None:
    """Wrap dist.shrink_group (torch >= 2.10) so that groups of group_type shrink through jacklring,
    and groups for which resolve() names one (a torch group over jacklring's C++ Backend) through
    that one; the shrunk group is then a Python one."""
    global _installed
    original = getattr(c10d, "shrink_group", None)
    if _installed or original is None:
        return

    @functools.wraps(original)
    def shrink_group(ranks_to_exclude: list[int], group: Any = None, shrink_flags: int = 0,
                     pg_options: Any = None) -> Any:
        target = group if group is not None else c10d._get_default_group()
        if isinstance(target, group_type):
            return _shrink(target, target, ranks_to_exclude, shrink_flags)
        behind = resolve(target) if resolve is not None else None  # the Python group behind a C++ Backend
        if behind is not None:
            return _shrink(target, behind, ranks_to_exclude, shrink_flags)
        return original(ranks_to_exclude, group, shrink_flags, pg_options)

    c10d.shrink_group = shrink_group
    if getattr(dist, "shrink_group", None) is original:
        dist.shrink_group = shrink_group
    _installed = True


def _shrink(target: Any, group: Any, ranks_to_exclude: list[int], shrink_flags: int) -> Any:
    """target: the group torch knows; group: the jacklring (Python) group that runs it."""
    missing = [name for name in _HELPERS if not hasattr(c10d, name)]
    if missing:
        raise TypeError(f"rank {target.rank()}: dist.shrink_group on a jacklring group needs torch's "
                        f"{', '.join(missing)}, which this torch ({dist.__name__}) lacks")
    c10d._validate_shrink_inputs(ranks_to_exclude, shrink_flags)
    info = c10d._prepare_shrink_target_group(target)
    excluded = sorted(c10d._validate_and_process_excluded_ranks(ranks_to_exclude, info))
    is_default = info["is_default_group"]
    members = c10d.get_process_group_ranks(target)  # global ranks, in group-rank order
    remaining = [g for i, g in enumerate(members) if i not in excluded]
    metadata = c10d._extract_group_metadata(target)
    name = metadata["new_group_name"]
    if shrink_flags == getattr(c10d, "SHRINK_ABORT", 1):
        _abort_in_flight(group, excluded)
    new_pg = group.shrunk(excluded, c10d.PrefixStore(f"{name}/", metadata["store"]), name)
    if is_default:
        c10d._destroy_all_other_groups(exclude_group=target)
    c10d._cleanup_original_group(target, is_default)  # shuts the old group down (its communicator too)
    new_pg._set_group_name(name)
    new_pg._set_group_desc("default:shrunken" if is_default else f"{metadata['original_group_name']}:shrunk")
    c10d._register_pg_in_world(pg=new_pg, backend_name=metadata["backend_name"], store=metadata["store"],
                               group_name=name, backend_config=metadata["backend_config"],
                               rank_mapping={g: i for i, g in enumerate(remaining)})
    if is_default:
        c10d._update_default_pg(new_pg)
    return new_pg


def _abort_in_flight(target: Any, excluded: list[int]) -> None:
    """SHRINK_ABORT: fail this rank's operations of the old group now (the ring's links close, so
    a collective waiting on them raises at once and the ranks it waits for see the same)."""
    comm = getattr(target, "_comm", None)  # the adapter Backend under the process group
    break_links = getattr(comm, "break_links", None)
    if break_links is not None:
        break_links(f"rank {target.rank()}: dist.shrink_group({excluded}, SHRINK_ABORT) aborted this group's "
                    f"operations in flight")
