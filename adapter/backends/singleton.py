"""The group of one: every collective is the identity (spec: collectives are no-ops at size 1)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import DistributedError, QuorumError
from .base import Backend, ReduceOp


class SingletonBackend(Backend):
    name = "singleton"

    def set_timeout(self, seconds: float) -> None:
        """A group of one never waits."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def all_reduce(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        if dst is not src:
            dst[...] = src

    def all_gather(self, src: np.ndarray, dst: np.ndarray) -> None:
        if dst is not src:
            dst[...] = src

    def reduce_scatter(self, src: np.ndarray, dst: np.ndarray, op: ReduceOp) -> None:
        if dst is not src:
            dst[...] = src

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if root != 0:
            raise DistributedError(f"broadcast root {root} does not exist in a group of size 1")

    def barrier(self) -> None:
        pass

    def shrink(self, exclude: Sequence[int], min_size: int | None, timeout: float) -> "SingletonBackend":
        """Nothing to agree on: the one rank carries on alone (Group.shrink returns None if it
        excluded itself)."""
        if min_size is not None and min_size > 1:
            raise QuorumError(f"rank 0: shrink: a group of one cannot hold min_size={min_size} ranks")
        return SingletonBackend()

    def send(self, buf: np.ndarray, dst: int) -> None:
        raise DistributedError("send() needs a peer: this group has only rank 0 (size 1)")

    def recv(self, buf: np.ndarray, src: int) -> None:
        raise DistributedError("recv() needs a peer: this group has only rank 0 (size 1)")

    def split(self, color: int, key: int) -> Backend:
        return SingletonBackend()
