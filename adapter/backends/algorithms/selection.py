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
    # log2(p) (+2 folding) pair steps over point-to-point connections, each dearer than a ring hop.
    # netns runs "after-4" (load 12), "after-8" (load 16-24), "after-16" (load 17-32),
    # docs/benchmarks.md, chosen vs native: 4 B rd 1.04 vs 0.83 ms (4 hosts: rd loses),
    # 3.1 vs 8.9 ms (8), 14.4 vs 41.4 ms (16); 64 KiB rh 1.7 vs 2.4 ms (4), 7.8 vs 10.6 ms (8),
    # 31.3 vs 78.4 ms (16); 1 MiB rh 9.6 vs 8.8 ms (4: rh loses), 25.7 vs 26.9 ms (8),
    # 60.2 vs 86.5 ms (16). 16 MiB: not measured with rh; the pipelined ring keeps it.
    Row("all_reduce", "ring", 8, 16 << 10, "rd"),
    Row("all_reduce", "ring", 8, 1 << 20, "rh"),
    Row("all_reduce", "ring", 4, 16 << 10, "native"),
    Row("all_reduce", "ring", 4, 64 << 10, "rh"),
    # JACCL mesh, all_reduce: its one step sends n - 1 messages per rank through one interface;
    # rd sends log2(p). Same runs: 4 B rd 4.0 vs 6.2 ms (8 hosts), 21.5 vs 24.7 ms (16 hosts);
    # 64 KiB rh 10.6 vs 10.1 ms (8: a tie), 43.6 vs 53.6 ms (16); 1 MiB rh 23.7 vs 29.1 ms,
    # 69.5 vs 180 ms. Below 8 ranks not measured: the mesh keeps its one step.
    Row("all_reduce", "jaccl", 8, 16 << 10, "rd"),
    Row("all_reduce", "jaccl", 8, 1 << 20, "rh"),
    # all_gather, reduce_scatter, broadcast, barrier: by the step counts (n - 1 ring hops, or
    # n - 1 mesh messages, against log2 n), small messages only; not measured in netns yet.
    # From 8 ranks, as all_reduce's rd: at 4 a point-to-point step costs more than a ring hop.
    Row("all_gather", "ring", 8, 16 << 10, "rd"),
    Row("reduce_scatter", "ring", 8, 256 << 10, "rh"),
    Row("broadcast", "ring", 8, 64 << 10, "tree"),
    Row("barrier", "ring", 8, _INF, "dissemination"),
    Row("all_gather", "jaccl", 8, 16 << 10, "rd"),
    Row("reduce_scatter", "jaccl", 8, 256 << 10, "rh"),
    Row("broadcast", "jaccl", 8, 64 << 10, "tree"),
    Row("barrier", "jaccl", 8, _INF, "dissemination"),
)

# The folded schedules of a group size that is not a power of two add two steps: below this many
# ranks they take as many steps as the ring (3 ranks: 3 against 2; 5: 4 against 4), so a row's
# group sizes that are not a power of two start here.
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
    value is a ConfigError there), then the table (between hosts; native on one host); choices
    are cached per (collective, bytes)."""

    def __init__(self, backend: str, size: int, between_hosts: bool = True) -> None:
        self.backend, self.size = backend, size
        # The table was measured between hosts; a group entirely on this host keeps its own
        # schedule there (hops cost scheduler rounds, not network steps), unless one is forced.
        self.between_hosts = between_hosts
        self.forced: dict[str, str] = dict(config.get("JACKLRING_ALGORITHM"))
        self._cache: dict[tuple[str, int], str] = {}

    def choose(self, collective: str, nbytes: int) -> str:
        key = (collective, nbytes)
        found = self._cache.get(key)
        if found is None:
            found = self.forced.get(collective, "auto")
            if found == "auto":
                found = choose_from_table(collective, self.backend, nbytes, self.size) if self.between_hosts else "native"
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[key] = found
        return found
