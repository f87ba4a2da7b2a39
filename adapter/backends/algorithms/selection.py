"""Which schedule a collective between hosts runs: the one table, by operation, backend, message
size and group size, and JACKLRING_ALGORITHM, which forces one per collective.

Names: rd (recursive doubling), rh (Rabenseifner: recursive halving, then recursive doubling),
tree (binomial broadcast), dissemination (barrier), native (the backend's own schedule: the
ring's one-pass path and pipelined reduce-scatter + all-gather over both directions, its chain
broadcast; JACCL's one-step mesh exchange and mesh reduce-scatter + all-gather, its scatter
broadcast). Every rank computes the same choice from the same inputs, so all ranks of a group
run the same schedule.

Each row carries the measurement that set it (benchmarks/netns_bench.py, one rank per network
namespace, 10 Gbit/s tbf links, on the shared 2-core host; docs/benchmarks.md has the tables).
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import config


@dataclass(frozen=True)
class Row:
    collective: str
    backend: str        # "ring", "jaccl" or "*"
    min_ranks: int      # the row applies from this group size up
    max_bytes: int      # ... to messages of at most this many bytes (per rank's input)
    choice: str


_INF = 1 << 62

# First matching row wins; no row: native. Measured rows cite their run (docs/benchmarks.md,
# "Log-latency schedules"); the rest follow the step counts (docs/algorithms.md).
TABLE: tuple[Row, ...] = (
    # Ring, all_reduce. The one-pass path takes n - 1 hops and sends (n - 1) x the message; rd takes
    # log2(p) (+2 folding) pair steps. Fewer steps than n - 1 from 4 ranks (a power of two) and 6
    # (folded). netns 8 hosts: rd 4 B  vs native, 64 KiB rh vs native (run A, docs/benchmarks.md).
    Row("all_reduce", "ring", 4, 16 << 10, "rd"),
    Row("all_reduce", "ring", 4, 4 << 20, "rh"),
    # JACCL mesh, all_reduce: its one step sends n - 1 messages per rank through one interface;
    # rd sends log2(p). netns 8 and 16 hosts (run A).
    Row("all_reduce", "jaccl", 8, 16 << 10, "rd"),
    Row("all_reduce", "jaccl", 8, 1 << 20, "rh"),
    # all_gather, reduce_scatter, broadcast, barrier: by the step counts (n - 1 ring hops, or
    # n - 1 mesh messages, against log2 n), small messages only.
    Row("all_gather", "ring", 4, 16 << 10, "rd"),
    Row("reduce_scatter", "ring", 4, 256 << 10, "rh"),
    Row("broadcast", "ring", 4, 64 << 10, "tree"),
    Row("barrier", "ring", 4, _INF, "dissemination"),
    Row("all_gather", "jaccl", 8, 16 << 10, "rd"),
    Row("reduce_scatter", "jaccl", 8, 256 << 10, "rh"),
    Row("broadcast", "jaccl", 8, 64 << 10, "tree"),
    Row("barrier", "jaccl", 8, _INF, "dissemination"),
)

# The folded schedules of a group size that is not a power of two add two steps: below this many
# ranks they take as many steps as the ring (3 ranks: 3 against 2; 5: 4 against 4).
_FOLDED_FROM = 6


def _fits(row: Row, collective: str, backend: str, nbytes: int, size: int) -> bool:
    if row.collective != collective or row.backend not in ("*", backend):
        return False
    if size < row.min_ranks or nbytes > row.max_bytes:
        return False
    return size & (size - 1) == 0 or size >= _FOLDED_FROM


def choose_from_table(collective: str, backend: str, nbytes: int, size: int) -> str:
    for row in TABLE:
        if _fits(row, collective, backend, nbytes, size):
            return row.choice
    return "native"


class Chooser:
    """One group's choices: JACKLRING_ALGORITHM read once, at the group's creation (a malformed
    value is a ConfigError there), then the table; choices are cached per (collective, bytes)."""

    def __init__(self, backend: str, size: int) -> None:
        self.backend, self.size = backend, size
        self.forced: dict[str, str] = dict(config.get("JACKLRING_ALGORITHM"))
        self._cache: dict[tuple[str, int], str] = {}

    def choose(self, collective: str, nbytes: int) -> str:
        key = (collective, nbytes)
        found = self._cache.get(key)
        if found is None:
            found = self.forced.get(collective, "auto")
            if found == "auto":
                found = choose_from_table(collective, self.backend, nbytes, self.size)
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[key] = found
        return found
