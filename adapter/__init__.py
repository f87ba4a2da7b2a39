"""jacklring: collectives over numpy, cupy and torch buffers (the public API)."""
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

__all__ = [
    "Group", "init", "is_available", "shutdown", "ReduceOp",
    "all_sum", "all_max", "all_min", "all_reduce", "all_gather", "sum_scatter", "reduce_scatter",
    "broadcast", "barrier", "send", "recv", "recv_like",
    "DistributedError", "ConfigError", "BackendUnavailable", "PeerError", "MismatchError",
    "CollectiveTimeout", "IntegrityError", "ResourceExhausted", "ExcludedError", "QuorumError",
    "culprit_of", "average_gradients",
    "AllToShardedLinear", "ShardedToAllLinear", "shard_linear", "shard_inplace",
]

_PARALLEL = ("AllToShardedLinear", "ShardedToAllLinear", "shard_linear", "shard_inplace")


def __getattr__(name: str):
    """The tensor-parallel layers need torch: load them on first use so `import adapter` needs numpy only."""
    if name in _PARALLEL:
        from . import parallel

        return getattr(parallel, name)
    raise AttributeError(f"module 'adapter' has no attribute {name!r}")

from .torch_backend import autoload as _register_torch_backend  # noqa: E402  (after the public names it re-exports)

# Registers "jacklring" with torch.distributed when torch is already imported; never imports torch.
_register_torch_backend()
