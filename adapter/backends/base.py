"""The small interface every backend implements.

Buffers are 1-D, C-contiguous numpy arrays of the logical dtype (ml_dtypes.bfloat16
included), or DeviceBuffers for a backend that sets takes_device_buffers (NCCL). The ops
layer does all conversion from torch / cupy and all shape checks; a backend only moves and
reduces elements.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import DistributedError


class ReduceOp(enum.Enum):
    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    # Members are singletons compared by identity: hash them in C (Enum's own __hash__ is Python,
    # and a small collective looks an op up in a few dicts).
    __hash__ = object.__hash__


@dataclass(frozen=True)
class DeviceBuffer:
    """`count` contiguous elements of `dtype` at device address `ptr` on CUDA device `device`.

    `stream` is the raw CUDA stream handle the owner's pending work is ordered on (0 = the
    legacy default stream); NCCL runs there, so no extra synchronisation is needed. `owner`
    (a cupy array or torch tensor) keeps the memory alive while the buffer is in use."""

    ptr: int
    count: int
    dtype: np.dtype
    device: int
    stream: int = 0
    owner: Any = None

    @property
    def nbytes(self) -> int:
        return self.count * np.dtype(self.dtype).itemsize


class GroupFailure:
    """Why a group can no longer be used: the first reason recorded wins, and every later
    operation raises the same DistributedError naming it. One per group (Backend.failure)."""

    __slots__ = ("why", "_owner", "_final")

    def __init__(self, owner: str) -> None:
        self.why: str | None = None
        self._owner = owner  # "rank 3: this ring group"
        self._final: DistributedError | None = None

    def mark(self, why: object) -> None:
        if self.why is None:
            self.why = str(why) or type(why).__name__

    def retire(self, error: DistributedError) -> None:
        """The group was replaced (shrink()): every later operation raises `error`, whatever failed before."""
        self._final = error
        self.mark(error)

    @property
    def retired(self) -> bool:
        return self._final is not None

    def check(self) -> None:
        if self._final is not None:
            raise type(self._final)(str(self._final))
        if self.why is not None:
            raise DistributedError(f"{self._owner} is unusable after an earlier error ({self.why}); "
                                   f"create a new one")


def split_members(colors: Sequence[int], keys: Sequence[int], color: int) -> list[int]:
    """The parent ranks that passed `color` to split(), in sub-group rank order: by (key, parent
    rank). Every backend plans its sub-groups with this one rule."""
    return sorted((r for r in range(len(colors)) if colors[r] == color), key=lambda r: (keys[r], r))


class Backend(abc.ABC):
    """One communicator: a fixed set of ranks that run collectives together."""

    name: str = "?"
    # True for a backend that reads and writes GPU memory itself (NCCL): the ops layer then hands
    # it device buffers as they are instead of staging them through host memory.
    takes_device_buffers: bool = False
    # A backend whose all_reduce of numpy arrays has a one-call native path (the engine's Shell,
    # csrc/python/shell.c): fast.all_reduce(x, out, engine op code) -> result or NotImplemented.
    fast: object | None = None

    @abc.abstractmethod
    def rank(self) -> int: ...

    @abc.abstractmethod
    def size(self) -> int: ...

    @abc.abstractmethod
    def all_reduce(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        """dst = op over ranks of src. src may be dst (in place); same dtype and size on every rank."""

    @abc.abstractmethod
    def all_gather(self, src: np.ndarray, dst: np.ndarray) -> None:
        """dst (size() * src.size elements) = concatenation of every rank's src, in rank order."""

    @abc.abstractmethod
    def reduce_scatter(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        """dst = this rank's block (dst.size elements) of op over ranks of src (size() * dst.size)."""

    @abc.abstractmethod
    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """buf on every rank = buf on root (in place)."""

    @abc.abstractmethod
    def barrier(self) -> None: ...

    @abc.abstractmethod
    def send(self, buf: np.ndarray, dst: int) -> None: ...

    @abc.abstractmethod
    def recv(self, buf: np.ndarray, src: int) -> None:
        """Fill buf (exact size expected) with a message from src."""

    @abc.abstractmethod
    def split(self, color: int, key: int) -> "Backend":
        """A new communicator of the ranks that passed the same color, ordered by (key, rank)."""

    # What a backend that cannot shrink lacks (named in shrink()'s error).
    shrink_missing: str = "it has no way to agree on the survivors and re-form without the dead ranks"

    def shrink(self, exclude: Sequence[int], min_size: int | None, timeout: float) -> "Backend":
        """A new communicator of the members that are alive, minus `exclude`, ranks numbered in
        their old order; called on every survivor (see Group.shrink for the rules)."""
        raise DistributedError(f"rank {self.rank()}: the {self.name} backend cannot shrink a group; "
                               f"{self.shrink_missing}. Restart the job without the failed rank, or use the "
                               f"ring backend (init(backend='ring')), which can")

    def grow(self, count: int | None, timeout: float) -> "Backend":
        """A new communicator of the members (ranks kept) and `count` newcomers (after them);
        called on every member (see Group.grow for the rules)."""
        raise DistributedError(f"rank {self.rank()}: the {self.name} backend cannot take newcomers into a group "
                               f"(grow); use the ring backend (init(backend='ring')), which can")

    @abc.abstractmethod
    def set_timeout(self, seconds: float) -> None:
        """The per-operation deadline from now on (the torch process group passes its own)."""

    @property
    def failure(self) -> GroupFailure:
        """This group's failure state, shared by every operation: after an error (or close())
        the group is unusable and says why, the same way on every backend."""
        failure = self.__dict__.get("_failure")
        if failure is None:
            failure = self.__dict__["_failure"] = GroupFailure(f"rank {self.rank()}: this {self.name} group")
        return failure

    def close(self) -> None:
        """Release sockets and threads. Safe to call twice."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank()} of {self.size()}>"
