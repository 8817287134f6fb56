"""The arithmetic behind every reported figure: percentiles, rates and ratios to bounds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

GB = 1e9  # bandwidth is reported in decimal GB/s


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]; NaN for no samples."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    if not samples:
        return math.nan
    ordered = sorted(samples)
    rank = max(1, math.ceil(round(q * len(ordered) / 100, 9)))  # 99 * 1000 / 100 is not 990.0000001
    return ordered[rank - 1]


def rate(amount: float, seconds: float) -> float:
    """amount per second; NaN when nothing was timed."""
    return amount / seconds if seconds > 0 else math.nan


def ratio(measured: float, bound: float) -> float:
    """measured / bound; NaN when either side is missing or the bound is not positive."""
    if math.isnan(measured) or math.isnan(bound) or bound <= 0:
        return math.nan
    return measured / bound


@dataclass(frozen=True)
class Latency:
    """Round-trip latency percentiles, in microseconds."""

    p50_us: float
    p99_us: float
    p999_us: float
    samples: int

    @classmethod
    def of(cls, samples_us: Sequence[float]) -> Latency:
        return cls(percentile(samples_us, 50), percentile(samples_us, 99),
                   percentile(samples_us, 99.9), len(samples_us))


@dataclass(frozen=True)
class Compared:
    """A figure next to the bound (or peer) it is held against, and their ratio."""

    measured: float
    bound: float
    ratio: float

    @classmethod
    def of(cls, measured: float, bound: float) -> Compared:
        return cls(measured, bound, ratio(measured, bound))
