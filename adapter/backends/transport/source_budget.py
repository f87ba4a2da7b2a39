"""How many failed handshakes one source may cost per second: a token bucket per source (an IP
address, or a local uid). A connection takes a token when it arrives and gives it back when it
proves the key (refund), so only failures spend the budget; a source without tokens is served
on probation (acceptor.py), so what a flood from an address spends never refuses a real peer
from the same address."""
from __future__ import annotations

import time

HANDSHAKES_PER_S = 50.0   # refill per source: a real rank opens a handful of connections per group
BURST = 100               # what one source may open at once (a ring forming on one host, its p2p links)
MAX_SOURCES = 1024        # buckets kept; full ones are forgotten first


class SourceBudget:
    """Token buckets keyed by source; take() says whether that source may start one more."""

    def __init__(self, rate: float = HANDSHAKES_PER_S, burst: int = BURST) -> None:
        self._rate, self._burst = rate, float(burst)
        self._buckets: dict[object, tuple[float, float]] = {}   # source -> (tokens, when)

    def take(self, source: object, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        tokens, when = self._buckets.get(source, (self._burst, now))
        tokens = min(self._burst, tokens + (now - when) * self._rate)
        allowed = tokens >= 1.0
        self._buckets[source] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > MAX_SOURCES:
            self._forget_full(now)
        return allowed

    def refund(self, source: object) -> None:
        """Give back the token of a connection from source that proved the key."""
        tokens, when = self._buckets.get(source, (self._burst, time.monotonic()))
        self._buckets[source] = (min(self._burst, tokens + 1.0), when)

    def _forget_full(self, now: float) -> None:
        full = [s for s, (tokens, when) in self._buckets.items()
                if tokens + (now - when) * self._rate >= self._burst]
        for source in full:
            del self._buckets[source]
        if len(self._buckets) > MAX_SOURCES:  # every source is mid-flood: keep the newest half
            for source in list(self._buckets)[:len(self._buckets) // 2]:
                del self._buckets[source]
