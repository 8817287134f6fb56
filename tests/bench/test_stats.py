"""The arithmetic behind the report: percentiles, rates, ratios, and per-step totals."""

import math

import pytest

from lmcache_mp.bench.harness.engine import RequestOutcome
from lmcache_mp.bench.harness.ranks import StepReport
from lmcache_mp.bench.harness.report import PhaseResult, span_seconds
from lmcache_mp.bench.harness.stats import Compared, Latency, percentile, rate, ratio


def test_percentile_is_nearest_rank():
    samples = list(range(1, 101))  # 1..100
    assert percentile(samples, 50) == 50
    assert percentile(samples, 99) == 99
    assert percentile(samples, 99.9) == 100
    assert percentile(samples, 100) == 100
    assert percentile(samples, 0) == 1
    assert percentile([7.0], 99.9) == 7.0
    assert percentile([3, 1, 2], 50) == 2  # unsorted input
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(samples, 101)


def test_latency_of_samples():
    latency = Latency.of([float(v) for v in range(1000, 0, -1)])
    assert (latency.p50_us, latency.p99_us, latency.p999_us, latency.samples) == \
        (500.0, 990.0, 999.0, 1000)


def test_ratio_and_rate():
    assert ratio(6.0, 12.0) == 0.5
    assert ratio(3.0, 1.0) == 3.0
    for measured, bound in ((1.0, 0.0), (1.0, -1.0), (math.nan, 1.0), (1.0, math.nan)):
        assert math.isnan(ratio(measured, bound))
    assert rate(10, 2) == 5
    assert math.isnan(rate(10, 0))
    compared = Compared.of(7.5, 2.5)
    assert (compared.measured, compared.bound, compared.ratio) == (7.5, 2.5, 3.0)


def test_span_is_first_start_to_last_end():
    assert span_seconds([(1.0, 2.0), None, (1.5, 3.5)]) == 2.5
    assert span_seconds([None, None]) == 0.0


def test_phase_totals_add_bytes_over_step_spans_and_count_hits():
    phase = PhaseResult("run")
    # Two ranks working at once: their store spans overlap, so the step took 2 s, not 3.
    phase.add_step(0.5, [
        StepReport(store=(10.0, 12.0), stored_bytes=4_000_000_000, verified_chunks=3),
        StepReport(store=(10.5, 11.5), stored_bytes=2_000_000_000, corrupt_chunks=1),
    ], [RequestOutcome("a", True, 600, 2, 0, 0, 0)])
    phase.add_step(1.5, [StepReport(load=(20.0, 21.0), loaded_bytes=5_000_000_000,
                                    peer_fetch=(21.0, 26.0), peer_fetched_bytes=5_000_000_000)],
                   [RequestOutcome("a", True, 600, 2, 2, 2, 512),
                    RequestOutcome("b", False, 600, 2, 0, 2, 0)])  # warm-up: not counted
    assert phase.stored_bytes == 6_000_000_000 and phase.store_seconds == 2.0
    assert phase.store_gbps == 3.0
    assert phase.retrieve_gbps == 5.0
    assert phase.peer_fetched_bytes / phase.peer_fetch_seconds / 1e9 == 1.0
    assert phase.steps[0].store_gbps == 3.0 and math.isnan(phase.steps[0].retrieve_gbps)
    assert phase.requests == 3
    assert (phase.counted_chunks, phase.hit_chunks, phase.ideal_hit_chunks) == (4, 2, 2)
    assert phase.hit_rate == 0.5
    assert (phase.prompt_tokens, phase.loaded_tokens) == (1200, 512)
    assert (phase.verified_chunks, phase.corrupt_chunks) == (3, 1)
    assert set(phase.tenants) == {"a"} and phase.tenants["a"].hit_rate == 0.5
