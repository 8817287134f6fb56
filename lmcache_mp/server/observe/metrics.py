"""Counters the loop keeps for STATS and /metrics: answers by op and outcome, latencies, copies.

Updated on the event loop thread only, with plain integer arithmetic (no locks): a LOOKUP
costs tens of microseconds, and its bookkeeping must not add to that.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, defaultdict

from ...protocol import Histogram

# Seconds to reply: a cached LOOKUP takes tens of microseconds, a big STORE seconds.
LATENCY_BOUNDS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
                  50e-3, 100e-3, 250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0)
# Seconds one request's copies took, from a single chunk to thousands.
COPY_BOUNDS = (100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3,
               250e-3, 500e-3, 1.0, 2.5, 5.0, 10.0, 30.0)

OK = "ok"  # the outcome of a request answered without an error


class _Buckets:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    def histogram(self) -> Histogram:
        return Histogram(list(self.bounds), list(self.counts), self.total)


class ServerMetrics:
    """What the server did since it started; the store and the registry know the rest."""

    def __init__(self) -> None:
        self._outcomes: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self._latency: dict[str, _Buckets] = {}
        self._copy_time: dict[str, _Buckets] = {}
        self.bytes_stored = 0
        self.bytes_retrieved = 0
        self.loop_lag = 0.0  # seconds; set by the LoopWatch
        self._disk_reads = _Buckets(COPY_BOUNDS)

    def disk_read(self, seconds: float) -> None:
        """One read-back window's reads from the disk tier took `seconds`."""
        self._disk_reads.observe(seconds)

    def disk_read_time(self) -> Histogram:
        return self._disk_reads.histogram()

    def answered(self, op: str, outcome: str, seconds: float) -> None:
        """A reply went out for `op` (an op name from the protocol's table, or `invalid`)."""
        self._outcomes[op][outcome] += 1
        buckets = self._latency.get(op)
        if buckets is None:
            buckets = self._latency[op] = _Buckets(LATENCY_BOUNDS)
        buckets.observe(seconds)

    def copied(self, direction: str, seconds: float) -> None:
        """One STORE's or RETRIEVE's copies (`direction` "store" or "retrieve") finished."""
        buckets = self._copy_time.get(direction)
        if buckets is None:
            buckets = self._copy_time[direction] = _Buckets(COPY_BOUNDS)
        buckets.observe(seconds)

    def outcomes(self) -> dict[str, dict[str, int]]:
        return {op: dict(counts) for op, counts in self._outcomes.items()}

    def latency(self) -> dict[str, Histogram]:
        return {op: buckets.histogram() for op, buckets in self._latency.items()}

    def copy_time(self) -> dict[str, Histogram]:
        return {direction: b.histogram() for direction, b in self._copy_time.items()}
