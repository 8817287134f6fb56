"""STATS: aggregate figures for engines, per tenant for admins (built off the loop)."""

from __future__ import annotations

import asyncio
import resource
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from ...protocol import (
    ROLE_ADMIN,
    InstanceStats,
    Packed,
    StatsReply,
    StatsRequest,
    TenantStats,
    pack,
)
from ..net.access import Session
from .context import OpContext

# Admin STATS replies built off the loop at once; more wait their turn on the loop, as all
# did before, so that pipelined STATS never hold more listings than this in memory.
MAX_STATS_OFF_LOOP = 2


class StatsOp:
    def __init__(self, ctx: OpContext, requests_served: Counter[str]):
        """`requests_served`: requests by op, as the dispatcher counts them."""
        self.ctx = ctx
        self.requests_served = requests_served
        self._off_loop = 0  # admin STATS being built off the loop

    def __call__(self, session: Session, req: StatsRequest) -> StatsReply | Awaitable[Packed]:
        """Aggregates for everyone; per-tenant figures and every registration for admins
        only: an engine sees its own engine's registrations and never a salt.

        An admin's reply lists every tenant: with per-user salts, thousands, whose figures
        took ~2 µs each to build and ~0.7 µs to pack, on the loop, in front of every other
        request. The loop copies the listing; a thread builds and packs the reply, for up
        to MAX_STATS_OFF_LOOP replies at a time."""
        admin = session.role == ROLE_ADMIN
        if not admin or self._off_loop >= MAX_STATS_OFF_LOOP:
            return self.snapshot(admin, session.engine)
        reply, tenants = self.snapshot_without_tenants(True, session.engine)

        def build() -> Packed:
            reply.tenants = tenants()
            return Packed(pack(reply))
        self._off_loop += 1
        built = asyncio.get_running_loop().run_in_executor(None, build)
        built.add_done_callback(self._built)
        return built

    def _built(self, _built: asyncio.Future) -> None:
        self._off_loop -= 1

    def snapshot(self, admin: bool = True, engine: bytes | None = None) -> StatsReply:
        """STATS as an admin (or, with `admin` false, as `engine`) sees it."""
        reply, tenants = self.snapshot_without_tenants(admin, engine)
        reply.tenants = tenants()
        return reply

    def snapshot_without_tenants(self, admin: bool = True, engine: bytes | None = None
                                 ) -> tuple[StatsReply, Callable[[], dict[str, TenantStats]]]:
        """snapshot(), less its tenants: with them, the function that lists them from the
        salts listed now, for any thread to call later (the metrics endpoint's, so that a
        scrape costs the loop a copy of the listing, not a walk of thousands of salts).
        Each tenant's figures are read when it is listed."""
        store, disk = self.ctx.store, self.ctx.disk
        listed = {**dict.fromkeys(store.quotas.configured()), **store.tenants} if admin else {}
        if admin and disk is not None:
            listed = {**dict.fromkeys(disk.space.salt_ids), **listed}

        def tenants() -> dict[str, TenantStats]:
            stats = {}
            for salt, usage in listed.items():
                quota = store.quotas.get(salt)
                stats[salt] = TenantStats(
                    usage.bytes_used if usage else 0, usage.chunks if usage else 0, quota.cap,
                    quota.reserve, usage.hits if usage else 0, usage.misses if usage else 0,
                    usage.evictions if usage else 0, usage.refused if usage else 0,
                    *(disk.usage(salt) if disk is not None else (0, 0)))
            return stats
        return self._figures(admin, engine), tenants

    def _figures(self, admin: bool, engine: bytes | None) -> StatsReply:
        ctx = self.ctx
        store, metrics, gpu_pool = ctx.store, ctx.metrics, ctx.gpu_pool
        rusage = resource.getrusage(resource.RUSAGE_SELF)  # ru_maxrss is in KiB on Linux
        return StatsReply(
            chunks=store.num_chunks, bytes_used=store.bytes_used,
            capacity_bytes=store.capacity, hits=store.total("hits"),
            misses=store.total("misses"), evictions=store.total("evictions"),
            leases_held=store.leases_held, holds_refused=store.holds_refused,
            pending_stores=store.pending,
            registrations=len(ctx.registry), requests=dict(self.requests_served),
            prefault_done=ctx.pool.prefault_done.is_set(),
            instances=[InstanceStats(i.instance_id, i.model, i.kv_world_size, i.kv_worker_id,
                                     i.tp_rank, i.stores, i.retrieves, i.loads_pushed)
                       for i in ctx.registry.instances() if admin or i.engine == engine],
            gpu_capacity_bytes=gpu_pool.capacity if gpu_pool is not None else 0,
            gpu_bytes_used=gpu_pool.allocator.used if gpu_pool is not None else 0,
            cpu_seconds=rusage.ru_utime + rusage.ru_stime, peak_rss_bytes=rusage.ru_maxrss * 1024,
            pinned_bytes=ctx.pool.pinned_bytes, outcomes=metrics.outcomes(),
            latency=metrics.latency(), copy_time=metrics.copy_time(),
            bytes_stored=metrics.bytes_stored, bytes_retrieved=metrics.bytes_retrieved,
            evictions_by_cause=dict(store.evictions_by_cause), clients=len(ctx.sessions),
            loop_lag_seconds=metrics.loop_lag, **self._lower_figures())

    def _lower_figures(self) -> dict[str, Any]:
        """Each lower tier's counters, as `<its name>_<field>`."""
        figures: dict[str, Any] = {}
        for tier in self.ctx.lower:
            figures[f"{tier.name}_enabled"] = True
            figures.update({f"{tier.name}_{name}": value
                            for name, value in asdict(tier.snapshot()).items()})
        if self.ctx.disk is not None:
            figures["disk_read_time"] = self.ctx.metrics.disk_read_time()
        return figures
