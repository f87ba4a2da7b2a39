"""jacklring: collectives over numpy, cupy and torch buffers (the public API).

The public names load on first use: `import torch` runs jacklring's torch plugin in every
program of the environment, which imports this package, and most of those programs (gloo's
too) never form a group, so they should not pay for loading the backends.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Where each public name lives (a module of this package, relative).
_PUBLIC = {
    "ReduceOp": ".backends.base",
    **{name: ".errors" for name in (
        "BackendUnavailable", "CollectiveTimeout", "ConfigError", "DistributedError", "ExcludedError",
        "IntegrityError", "MismatchError", "PeerError", "QuorumError", "ResourceExhausted", "culprit_of")},
    "average_gradients": ".gradients",
    **{name: ".group" for name in ("Group", "init", "is_available", "shutdown")},
    **{name: ".ops" for name in (
        "all_gather", "all_max", "all_min", "all_reduce", "all_sum", "barrier", "broadcast", "recv",
        "recv_like", "reduce_scatter", "send", "sum_scatter")},
    # The tensor-parallel layers need torch.
    **{name: ".parallel" for name in ("AllToShardedLinear", "ShardedToAllLinear", "shard_linear", "shard_inplace")},
}

__all__ = [
    "Group", "init", "is_available", "shutdown", "ReduceOp",
    "all_sum", "all_max", "all_min", "all_reduce", "all_gather", "sum_scatter", "reduce_scatter",
    "broadcast", "barrier", "send", "recv", "recv_like",
    "DistributedError", "ConfigError", "BackendUnavailable", "PeerError", "MismatchError",
    "CollectiveTimeout", "IntegrityError", "ResourceExhausted", "ExcludedError", "QuorumError",
    "culprit_of", "average_gradients",
    "AllToShardedLinear", "ShardedToAllLinear", "shard_linear", "shard_inplace",
]


def __getattr__(name: str) -> Any:
    """A public name, or a submodule (`adapter.group`), loaded when first asked for."""
    where = _PUBLIC.get(name)
    if where is not None:
        value = getattr(importlib.import_module(where, __name__), name)
        globals()[name] = value  # later lookups find it without this hook
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and editors see: the same names, imported at once
    from .backends.base import ReduceOp
    from .errors import (
        BackendUnavailable,
        CollectiveTimeout,
        ConfigError,
        DistributedError,
        ExcludedError,
        IntegrityError,
        MismatchError,
        PeerError,
        QuorumError,
        ResourceExhausted,
        culprit_of,
    )
    from .gradients import average_gradients
    from .group import Group, init, is_available, shutdown
    from .ops import (
        all_gather,
        all_max,
        all_min,
        all_reduce,
        all_sum,
        barrier,
        broadcast,
        recv,
        recv_like,
        reduce_scatter,
        send,
        sum_scatter,
    )
    from .parallel import AllToShardedLinear, ShardedToAllLinear, shard_inplace, shard_linear

from .torch_backend import autoload as _register_torch_backend  # noqa: E402  (after the hook above)

# Registers "jacklring" with torch.distributed when torch is already imported; never imports torch.
_register_torch_backend()
