"""torch.distributed calls the jacklring backend cannot serve yet, refused with an error that
says so instead of the one torch would raise on reaching into a Python process group's C++
backend ("Cannot access device backend for process group ...")."""
from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_installed = False


def install(group_type: type) -> None:
    """Wrap dist.shrink_group (torch >= 2.10) so that groups of group_type are refused."""
    global _installed
    original = getattr(c10d, "shrink_group", None)
    if _installed or original is None:
        return

    @functools.wraps(original)
    def shrink_group(ranks_to_exclude: list[int], group: Any = None, *args: Any, **kwargs: Any) -> Any:
        target = group if group is not None else c10d._get_default_group()
        if isinstance(target, group_type):
            raise TypeError(f"rank {target.rank()}: dist.shrink_group: the jacklring backend does not support "
                            f"shrinking a process group yet (excluding ranks {list(ranks_to_exclude)}); "
                            f"form a new group of the remaining ranks with dist.new_group instead")
        return original(ranks_to_exclude, group, *args, **kwargs)

    c10d.shrink_group = shrink_group
    if getattr(dist, "shrink_group", None) is original:
        dist.shrink_group = shrink_group
    _installed = True
