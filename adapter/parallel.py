"""Tensor-parallel linear layers for torch, after mlx.nn.layers.distributed.

Two layers split one matrix product across the ranks of a group:

- AllToShardedLinear: every rank holds the same input and a block of the output features
  (rows of the weight). Forward needs no communication; in backward the input's gradient
  is the sum of every rank's partial product, so it is all-summed.
- ShardedToAllLinear: every rank holds a block of the input features (columns of the
  weight) and the whole output is the sum of the partial products: all-summed in forward.
  The bias is added once, after the sum. Backward needs no communication, because every
  rank computes the same loss from the same (summed) output.

Paired as all-to-sharded then sharded-to-all (an MLP's up and down projections, attention's
qkv and output projections), a block costs one all_sum forward and one backward.
`segments` splits a fused weight (say qkv, three matrices stacked) into its parts before
sharding, so each rank holds its block of each part rather than one part whole.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from .group import Group, default_group
from .ops import all_sum

Segments = Union[int, Sequence[int], Sequence[float]]
Sharding = Union[str, Callable[[str, torch.Tensor], Any]]
SHARDINGS = ("all-to-sharded", "sharded-to-all")


# ---- communication with gradients --------------------------------------------------------------

class _SumGradients(torch.autograd.Function):
    """Identity forward; all_sum of the gradient in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_sum(grad.contiguous(), group=ctx.group), None


class _AllSum(torch.autograd.Function):
    """all_sum forward; identity gradient in backward (every rank holds the same loss)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return all_sum(x.contiguous(), group=group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_gradients(x: torch.Tensor, group: Group | None = None) -> torch.Tensor:
    """x unchanged, but its gradient is summed over the group in backward."""
    g = default_group(group)
    return x if g.size() == 1 else _SumGradients.apply(x, g)


def all_sum_with_grad(x: torch.Tensor, group: Group | None = None) -> torch.Tensor:
    """The sum of x over the group; the gradient passes back unchanged to every rank."""
    g = default_group(group)
    return x if g.size() == 1 else _AllSum.apply(x, g)


# ---- layers ------------------------------------------------------------------------------------

def _uniform(shape: tuple[int, ...], fan_in: int, device: Any, dtype: Any) -> nn.Parameter:
    # The full layer's init (as MLX and nn.Linear scale it): uniform in +-1/sqrt(input features).
    bound = 1.0 / math.sqrt(fan_in)
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype).uniform_(-bound, bound))


class AllToShardedLinear(nn.Module):
    """y_r = x W_r^T + b_r: the same input on every rank, this rank's block of the output features."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool = True, group: Group | None = None,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.group = default_group(group)
        n = self.group.size()
        if output_dims % n:
            raise ValueError(f"cannot shard {output_dims} output features across {n} ranks")
        self.input_dims, self.output_dims = input_dims, output_dims
        self.weight = _uniform((output_dims // n, input_dims), input_dims, device, dtype)
        self.bias = _uniform((output_dims // n,), input_dims, device, dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(sum_gradients(x, self.group), self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"input_dims={self.input_dims}, output_dims={self.output_dims}, bias={self.bias is not None}, "
                f"rank={self.group.rank()}/{self.group.size()}")

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, segments: Segments = 1, group: Group | None = None) -> "AllToShardedLinear":
        g = default_group(group)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, g,
                    linear.weight.device, linear.weight.dtype)
        _load_shards(layer, linear, _all_to_sharded(segments), g)
        return layer


class ShardedToAllLinear(nn.Module):
    """y = sum_r x_r W_r^T + b: this rank's block of the input features, the whole output on every rank."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool = True, group: Group | None = None,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.group = default_group(group)
        n = self.group.size()
        if input_dims % n:
            raise ValueError(f"cannot shard {input_dims} input features across {n} ranks")
        self.input_dims, self.output_dims = input_dims, output_dims
        self.weight = _uniform((output_dims, input_dims // n), input_dims, device, dtype)
        self.bias = _uniform((output_dims,), input_dims, device, dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_sum_with_grad(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"input_dims={self.input_dims}, output_dims={self.output_dims}, bias={self.bias is not None}, "
                f"rank={self.group.rank()}/{self.group.size()}")

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, segments: Segments = 1, group: Group | None = None) -> "ShardedToAllLinear":
        g = default_group(group)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, g,
                    linear.weight.device, linear.weight.dtype)
        _load_shards(layer, linear, _sharded_to_all(segments), g)
        return layer


def shard_linear(module: nn.Linear, sharding: str, *, segments: Segments = 1,
                 group: Group | None = None) -> nn.Module:
    """A new sharded layer holding this rank's block of module's parameters (module is unchanged)."""
    _check_sharding(sharding)
    if not isinstance(module, nn.Linear):
        raise TypeError(f"shard_linear takes a torch.nn.Linear, not {type(module).__name__}")
    kind = AllToShardedLinear if sharding == "all-to-sharded" else ShardedToAllLinear
    return kind.from_linear(module, segments=segments, group=group)


def shard_inplace(module: nn.Module, sharding: Sharding, *, segments: Segments = 1,
                  group: Group | None = None) -> None:
    """Replace every parameter of module by this rank's shard of it (no communication is added:
    the module must do its own). sharding: "all-to-sharded", "sharded-to-all", or a function
    (parameter name, tensor) -> axis | (axis, segments) | None (None: leave it whole)."""
    g = default_group(group)
    if isinstance(sharding, str):
        _check_sharding(sharding)
        sharding = _all_to_sharded(segments) if sharding == "all-to-sharded" else _sharded_to_all(segments)
    with torch.no_grad():
        for name, param in list(module.named_parameters()):
            piece = _shard_tensor(name, param, sharding, g)
            if piece is not None:
                param.data = piece


# ---- sharding ----------------------------------------------------------------------------------

def _check_sharding(sharding: str) -> None:
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding {sharding!r} is not supported; choose one of {', '.join(SHARDINGS)}")


def _all_to_sharded(segments: Segments) -> Callable:
    """Output features are split: the weight's rows (axis -2) and the bias."""
    def rule(name: str, weight: torch.Tensor) -> Any:
        if name.endswith("bias"):
            return -1, segments
        return max(weight.dim() - 2, 0), segments
    return rule


def _sharded_to_all(segments: Segments) -> Callable:
    """Input features are split: the weight's columns; the bias stays whole."""
    def rule(name: str, weight: torch.Tensor) -> Any:
        if name.endswith("bias"):
            return None
        return -1, segments
    return rule


def _split(x: torch.Tensor, segments: Segments, axis: int) -> list[torch.Tensor]:
    """Split like MLX: an int is a count of equal parts, a list of ints are split indices,
    a list of floats are fractions of the axis where the splits fall."""
    length = x.shape[axis]
    if isinstance(segments, int):
        if length % segments:
            raise ValueError(f"cannot split an axis of {length} into {segments} equal parts")
        return list(torch.tensor_split(x, segments, dim=axis))
    indices = [int(s * length) if isinstance(s, float) else int(s) for s in segments]
    return list(torch.tensor_split(x, indices, dim=axis))


def _shard_tensor(name: str, tensor: torch.Tensor, rule: Callable, group: Group) -> torch.Tensor | None:
    """This rank's block of each segment of tensor along the rule's axis, or None to keep it whole."""
    spec = rule(name, tensor)
    if spec is None:
        return None
    if isinstance(spec, int):
        axis, segments = spec, 1
    elif isinstance(spec, tuple) and len(spec) == 2:
        axis, segments = spec
    else:
        raise ValueError(f"a sharding rule must return an axis, (axis, segments) or None; got {spec!r} for {name}")
    n, r = group.size(), group.rank()
    blocks = [_split(part, n, axis)[r] for part in _split(tensor.detach(), segments, axis)]
    return torch.cat(blocks, dim=axis).contiguous()


def _load_shards(layer: nn.Module, linear: nn.Linear, rule: Callable, group: Group) -> None:
    with torch.no_grad():
        for name, param in layer.named_parameters():
            source = getattr(linear, name)
            piece = _shard_tensor(name, source, rule, group)
            param.copy_(source if piece is None else piece)
