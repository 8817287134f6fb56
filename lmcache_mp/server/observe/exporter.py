"""STATS figures as Prometheus metrics, with tenants labelled by name or keyed digest, never salt.

Runs on the HTTP thread, from a StatsReply the loop built: it reads nothing the loop changes.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from ...protocol import Histogram, StatsReply, TenantStats

PREFIX = "lmcache_mp_"
OTHER = "other"  # the tenant label of every salt beyond the labelled ones
DIGEST_CHARS = 10


class TenantLabels:
    """Which label each salt's metrics carry: its configured name, else `t-` and a short
    HMAC of the salt under the server's admin token (so a scraper cannot test guesses of a
    salt), for at most `limit` salts at once; any others are `other`. A salt keeps its label
    while it is listed, and frees its place when it is not."""

    def __init__(self, names: dict[str, str], key: bytes, limit: int):
        self.names = dict(names)
        self.key = key
        self.limit = limit
        self._digests: dict[str, str] = {}

    def digest(self, salt: str) -> str:
        mac = hmac.new(self.key, b"tenant-label\0" + salt.encode(), hashlib.sha256)
        return "t-" + mac.hexdigest()[:DIGEST_CHARS]

    def assign(self, salts: list[str]) -> dict[str, str]:
        """The label of each listed salt."""
        listed = set(salts)
        for salt in [s for s in self._digests if s not in listed]:
            del self._digests[salt]
        labels = {}
        for salt in salts:
            if salt in self.names:
                labels[salt] = self.names[salt]
            elif salt in self._digests:
                labels[salt] = self._digests[salt]
            elif len(self._digests) < self.limit:
                labels[salt] = self._digests[salt] = self.digest(salt)
            else:
                labels[salt] = OTHER
        return labels


def fold_tenants(tenants: dict[str, TenantStats], labels: TenantLabels
                 ) -> dict[str, TenantStats]:
    """Per label, the sum of its salts' figures (caps only for labels of one salt)."""
    assigned = labels.assign(sorted(tenants))
    folded: dict[str, TenantStats] = {}
    for salt, stats in tenants.items():
        label = assigned[salt]
        total = folded.get(label)
        if total is None:
            folded[label] = TenantStats(**vars(stats))
            continue
        for name in ("bytes_used", "chunks", "reserve", "hits", "misses", "evictions", "refused",
                     "disk_bytes", "disk_chunks"):
            setattr(total, name, getattr(total, name) + getattr(stats, name))
        total.cap = None
    return folded


def _histogram(family: HistogramMetricFamily, labels: list[str], hist: Histogram) -> None:
    cumulative, buckets = 0, []
    for bound, count in zip([*map(repr, hist.bounds), "+Inf"], hist.counts):
        cumulative += count
        buckets.append((bound, cumulative))
    family.add_metric(labels, buckets, hist.total)


def stats_metrics(stats: StatsReply, labels: TenantLabels) -> Iterator[Metric]:
    """Every metric docs/operations.md lists, from one STATS snapshot."""
    yield from _request_metrics(stats)
    yield CounterMetricFamily(PREFIX + "stored_bytes", "Bytes of chunks STORE placed in the "
                              "cache", value=stats.bytes_stored)
    yield CounterMetricFamily(PREFIX + "retrieved_bytes", "Bytes RETRIEVE copied into KV "
                              "caches", value=stats.bytes_retrieved)
    yield CounterMetricFamily(PREFIX + "hits", "Chunks LOOKUP found", value=stats.hits)
    yield CounterMetricFamily(PREFIX + "misses", "Chunks LOOKUP did not find",
                              value=stats.misses)
    evictions = CounterMetricFamily(PREFIX + "evictions", "Chunks evicted, by cause",
                                    labels=["cause"])
    for cause, count in sorted(stats.evictions_by_cause.items()):
        evictions.add_metric([cause], count)
    yield evictions
    yield from _pool_metrics(stats)
    if stats.l2_enabled:
        yield from _l2_metrics(stats)
    if stats.disk_enabled:
        yield from _disk_metrics(stats)
    yield from _tenant_metrics(fold_tenants(stats.tenants, labels))


def _request_metrics(stats: StatsReply) -> Iterator[Metric]:
    """Requests by op and outcome, their latency, and the copies' durations."""
    requests = CounterMetricFamily(PREFIX + "requests", "Requests answered, by op and outcome "
                                   "(ok, or the error code replied)", labels=["op", "outcome"])
    for op, outcomes in sorted(stats.outcomes.items()):
        for outcome, count in sorted(outcomes.items()):
            requests.add_metric([op, outcome], count)
    yield requests
    latency = HistogramMetricFamily(PREFIX + "request_duration_seconds", "Seconds from a "
                                    "request's arrival to its reply, by op", labels=["op"])
    for op, hist in sorted(stats.latency.items()):
        _histogram(latency, [op], hist)
    yield latency
    copies = HistogramMetricFamily(PREFIX + "copy_duration_seconds", "Seconds one STORE's or "
                                   "RETRIEVE's block copies took", labels=["direction"])
    for direction, hist in sorted(stats.copy_time.items()):
        _histogram(copies, [direction], hist)
    yield copies


def _pool_metrics(stats: StatsReply) -> Iterator[Metric]:
    """The pool's bytes by tier, and the server's other gauges of the moment."""
    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(PREFIX + name, doc, value=value)

    used = GaugeMetricFamily(PREFIX + "pool_used_bytes", "Bytes of the pool that chunks "
                             "take, by tier", labels=["tier"])
    capacity = GaugeMetricFamily(PREFIX + "pool_capacity_bytes", "Bytes of the pool, by tier",
                                 labels=["tier"])
    used.add_metric(["cpu"], stats.bytes_used - stats.gpu_bytes_used)
    capacity.add_metric(["cpu"], stats.capacity_bytes - stats.gpu_capacity_bytes)
    if stats.gpu_capacity_bytes:
        used.add_metric(["gpu"], stats.gpu_bytes_used)
        capacity.add_metric(["gpu"], stats.gpu_capacity_bytes)
    yield used
    yield capacity
    yield gauge("pool_pinned_bytes", "Bytes of the CPU pool pinned for GPU copies",
                stats.pinned_bytes)
    yield gauge("pool_prefault_done", "1 once the CPU pool is faulted in",
                int(stats.prefault_done))
    yield gauge("chunks", "Chunks in the cache", stats.chunks)
    yield gauge("pending_stores", "Chunks reserved by a STORE whose copy is running",
                stats.pending_stores)
    yield gauge("leases_held", "LOOKUP holds not yet retrieved, released or expired",
                stats.leases_held)
    yield CounterMetricFamily(PREFIX + "holds_refused", "LOOKUP holds not taken because the "
                              "server-wide lease limits were reached", value=stats.holds_refused)
    yield gauge("registered_workers", "KV caches registered by workers", stats.registrations)
    yield gauge("connected_clients", "Connections with a session", stats.clients)
    yield gauge("event_loop_lag_seconds", "How late the event loop last woke for a timer",
                stats.loop_lag_seconds)


def _tier_families(prefix: str) -> tuple[Callable[[str, str, float], CounterMetricFamily],
                                         Callable[[str, str, float], GaugeMetricFamily]]:
    """A lower tier's counter and gauge makers, their names under PREFIX + `prefix`."""
    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        return CounterMetricFamily(PREFIX + prefix + name, doc, value=value)

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(PREFIX + prefix + name, doc, value=value)
    return counter, gauge


def _l2_metrics(stats: StatsReply) -> Iterator[Metric]:
    """The L2 tier's figures (a server with --l2 only)."""
    counter, gauge = _tier_families("l2_")

    yield gauge("up", "1 unless the last L2 operation failed", int(stats.l2_up))
    yield counter("hits", "Chunks a LOOKUP's prefetch found in L2", stats.l2_hits)
    yield counter("misses", "Chunks a prefetch asked L2 for that it did not hold",
                  stats.l2_misses)
    yield counter("corrupt", "L2 values that failed their checks (counted as misses)",
                  stats.l2_corrupt)
    yield counter("read_bytes", "Value bytes fetched from L2", stats.l2_bytes_read)
    yield counter("written_bytes", "Value bytes written to L2", stats.l2_bytes_written)
    yield counter("zero_copy_bytes", "Of the value bytes read and written, those moved "
                  "straight between the CPU pool and L2 (Mooncake)", stats.l2_zero_copy_bytes)
    yield counter("written_chunks", "Chunks written to L2", stats.l2_chunks_written)
    yield counter("skipped_chunks", "Write-behind chunks not written: in L2 already",
                  stats.l2_chunks_skipped)
    yield counter("dropped_chunks", "Write-behind chunks dropped: queue full, L2 down or "
                  "over a budget", stats.l2_dropped)
    yield gauge("queue_bytes", "Chunk bytes waiting for write-behind", stats.l2_queue_bytes)
    yield gauge("queue_chunks", "Chunks waiting for write-behind", stats.l2_queue_chunks)
    yield gauge("held_bytes", "Bytes this server wrote that are still in L2 (its budget's "
                "usage)", stats.l2_bytes_held)
    yield counter("errors", "Failed L2 operations", stats.l2_errors)
    yield counter("prefetch_timeouts", "LOOKUPs answered before their prefetch finished",
                  stats.l2_prefetch_timeouts)


def _disk_metrics(stats: StatsReply) -> Iterator[Metric]:
    """The disk tier's figures (a server with --disk-dir only)."""
    counter, gauge = _tier_families("disk_")

    yield gauge("capacity_bytes", "Bytes the disk tier may fill (less after the disk ran out "
                "of room)", stats.disk_capacity_bytes)
    yield gauge("used_bytes", "Chunk bytes in the disk tier", stats.disk_bytes_used)
    yield gauge("chunks", "Chunks in the disk tier", stats.disk_chunks)
    yield gauge("writing", "1 unless writes are stopped after a failure",
                int(stats.disk_writing))
    yield gauge("loaded", "1 once the index is rebuilt from the journal", int(stats.disk_loaded))
    yield gauge("loaded_chunks", "Chunks the rebuild at start-up found",
                stats.disk_loaded_chunks)
    yield gauge("index_bytes", "Server memory the disk tier's index takes",
                stats.disk_index_bytes)
    yield counter("hits", "Chunks a LOOKUP read back from disk", stats.disk_hits)
    yield counter("misses", "Chunks a read-back looked for on disk and did not find",
                  stats.disk_misses)
    yield counter("corrupt", "Chunks that failed their checksum or were cut short (dropped, "
                  "counted as misses)", stats.disk_corrupt)
    yield counter("read_bytes", "Chunk bytes read back from disk", stats.disk_bytes_read)
    yield counter("written_bytes", "Chunk bytes written to disk", stats.disk_bytes_written)
    yield counter("written_chunks", "Chunks written to disk", stats.disk_chunks_written)
    yield counter("skipped_chunks", "Committed chunks not written: on disk already",
                  stats.disk_chunks_skipped)
    yield counter("dropped_chunks", "Chunks not written: queue full, no room, loading or "
                  "writes stopped", stats.disk_dropped)
    yield counter("over_budget_chunks", "Chunks not written: over --disk-write-budget",
                  stats.disk_over_budget)
    yield counter("evictions", "Chunks removed from disk to make room or keep a tenant under "
                  "its cap", stats.disk_evictions)
    yield gauge("queue_bytes", "Chunk bytes waiting to be written", stats.disk_queue_bytes)
    yield gauge("queue_chunks", "Chunks waiting to be written", stats.disk_queue_chunks)
    yield counter("write_busy_seconds", "Seconds write-through had chunks to write (written "
                  "bytes over it: the write rate)", stats.disk_write_busy_seconds)
    yield counter("read_errors", "Failed disk reads", stats.disk_read_errors)
    yield counter("write_errors", "Failed disk writes or syncs", stats.disk_write_errors)
    yield counter("prefetch_timeouts", "LOOKUPs answered before their read-back finished",
                  stats.disk_prefetch_timeouts)
    if stats.disk_read_time is not None:
        family = HistogramMetricFamily(PREFIX + "disk_read_duration_seconds", "Seconds one "
                                       "read-back window's disk reads took", labels=[])
        _histogram(family, [], stats.disk_read_time)
        yield family


def _tenant_metrics(tenants: dict[str, TenantStats]) -> Iterator[Metric]:
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "bytes_used": GaugeMetricFamily(PREFIX + "tenant_used_bytes", "Bytes a tenant's "
                                        "chunks take", labels=["tenant"]),
        "chunks": GaugeMetricFamily(PREFIX + "tenant_chunks", "A tenant's chunks",
                                    labels=["tenant"]),
        "cap": GaugeMetricFamily(PREFIX + "tenant_cap_bytes", "A tenant's quota cap (absent "
                                 "when unlimited)", labels=["tenant"]),
        "reserve": GaugeMetricFamily(PREFIX + "tenant_reserved_bytes", "Bytes reserved for a "
                                     "tenant by its quota", labels=["tenant"]),
        "hits": CounterMetricFamily(PREFIX + "tenant_hits", "Chunks LOOKUP found for a tenant",
                                    labels=["tenant"]),
        "misses": CounterMetricFamily(PREFIX + "tenant_misses", "Chunks LOOKUP did not find "
                                      "for a tenant", labels=["tenant"]),
        "evictions": CounterMetricFamily(PREFIX + "tenant_evictions", "A tenant's chunks "
                                         "evicted", labels=["tenant"]),
        "refused": CounterMetricFamily(PREFIX + "tenant_refusals", "A tenant's chunks a STORE "
                                       "could not place", labels=["tenant"]),
        "disk_bytes": GaugeMetricFamily(PREFIX + "tenant_disk_bytes", "Bytes a tenant's "
                                        "chunks take in the disk tier", labels=["tenant"]),
        "disk_chunks": GaugeMetricFamily(PREFIX + "tenant_disk_chunks", "A tenant's chunks "
                                         "in the disk tier", labels=["tenant"]),
    }
    for label, stats in sorted(tenants.items()):
        for name, family in families.items():
            value = getattr(stats, name)
            if value is not None:
                family.add_metric([label], value)
    yield from families.values()


class StatsCollector:
    """A prometheus_client collector over the latest snapshot `snapshot()` returns."""

    def __init__(self, snapshot: Callable[[], StatsReply], labels: TenantLabels):
        self.snapshot = snapshot
        self.labels = labels
        self._lock = threading.Lock()  # TenantLabels is shared by concurrent scrapes

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot()
        with self._lock:
            metrics = list(stats_metrics(stats, self.labels))
        yield from metrics


def exposition(snapshot: Callable[[], StatsReply], labels: TenantLabels
               ) -> Callable[[], bytes]:
    """A function that renders /metrics: the server's figures and the process's own."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(snapshot, labels))
    ProcessCollector(namespace="lmcache_mp", registry=registry)
    return lambda: generate_latest(registry)
