"""The server lifecycle: signals, starting the wired parts in order, housekeeping, shutdown."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import os
import signal
import time

import torch
import uvloop

from .. import __version__, protocol, runtime
from ..sizes import format_size
from .cache.quotas import QuotaError
from .net.http_endpoint import HttpEndpoint, Unavailable
from .observe.exporter import TenantLabels, exposition
from .observe.gc_guard import CollectorGuard
from .observe.loop_watch import LoopWatch
from .wiring import Components

logger = logging.getLogger("lmcache_mp.server")

_HOUSEKEEPING_S = 0.5
# Leases released at a time when many expire together (~1 ms of the loop on 2 cores).
_LEASE_EXPIRY_SLICE = 256
_REFUSALS_LOG_INTERVAL_S = 60.0  # the least time between two lines about holds not taken
_STUCK_REQUESTS_S = 2.0  # at shutdown, once copies ended: what requests still waiting get


def hold_exit_signals() -> list[signal.Signals]:
    """Keep SIGINT and SIGTERM for the server to act on once it runs: wiring can take
    seconds (a warm start adopting a million chunks), and a stop asked meanwhile must still
    drain and write the snapshot, not kill the process. Returns where they are kept."""
    held: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, _frame: held.append(signal.Signals(number)))
    return held


class Server:
    """serve() = install signal handlers → startup() → main_loop() → shutdown(), over the
    parts wiring.wire() built."""

    def __init__(self, parts: Components, held_signals: list[signal.Signals] | None = None):
        """`held_signals`: SIGINT or SIGTERM received while the parts were built
        (hold_exit_signals()), acted on as soon as the server runs."""
        self.parts = parts
        self._held_signals = held_signals if held_signals is not None else []
        self.config = parts.config
        self.should_exit = False
        self._loop_watch = LoopWatch(parts.metrics)
        self._collector_guard = CollectorGuard()
        self._http: HttpEndpoint | None = None  # with --metrics-port, from startup() on
        self._background: list[asyncio.Task] = []  # housekeeping and the loop watch
        self._abandoned = False  # shutdown left a thread stuck in the disk (disk/tier.py)

    def run(self) -> None:
        uvloop.run(self.serve())
        if self._abandoned:
            # The interpreter would join that thread at exit, for as long as the disk keeps
            # it: everything else is closed and logged, and a crash from here on leaves
            # nothing wrong (the disk tier's guarantee): end the process now.
            logger.warning("exiting without waiting for the disk tier's stuck thread")
            logging.shutdown()
            os._exit(0)

    async def serve(self) -> None:
        exit_requested = asyncio.Event()
        self.install_signal_handlers(exit_requested)
        if self._held_signals:
            self._handle_exit(self._held_signals[0], exit_requested)
        await self.startup()
        await exit_requested.wait()
        await self.shutdown()

    def install_signal_handlers(self, exit_requested: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._handle_exit, sig, exit_requested)
        loop.add_signal_handler(signal.SIGHUP, self._reload_quotas)

    def _reload_quotas(self) -> None:
        try:
            self.parts.dispatcher.reload_quota_file()
        except QuotaError as exc:
            logger.error("SIGHUP: quotas not reloaded, the old ones stay: %s", exc)
            return
        logger.info("SIGHUP: reloaded quotas from %s", self.config.quota_file)

    def _handle_exit(self, sig: signal.Signals, exit_requested: asyncio.Event) -> None:
        if self.should_exit:
            logger.warning("second %s: exiting now", sig.name)
            os._exit(1)
        logger.info("%s received: draining (up to %.0f s); send it again to exit at once",
                    sig.name, self.config.shutdown_timeout)
        self.should_exit = True
        exit_requested.set()

    async def startup(self) -> None:
        config, parts = self.config, self.parts
        loop = asyncio.get_running_loop()
        parts.pool.start_prefault()
        for tier in parts.lower:
            tier.start()
        parts.fd_channel.start(loop)
        parts.router.bind()
        parts.router.start(loop)
        self._background = [asyncio.create_task(self._housekeeping_loop()),
                            asyncio.create_task(self._loop_watch.run())]
        if config.metrics_port:
            self._http = self._open_http_endpoint(loop)
        # Everything built so far (torch's modules above all) lives as long as the process:
        # out of the collector's sight, a full collection costs ~0.2 ms instead of ~100 ms,
        # which a request allocating a few thousand keys would otherwise trigger. What the
        # store keeps later is frozen likewise, once a full collection grows long.
        gc.freeze()
        self._collector_guard.install()
        self._log_start()

    def _log_start(self) -> None:
        config, parts = self.config, self.parts
        has_cuda = parts.copier is not None
        logger.info("lmcache-mp-server %s serving on %s (runtime directory %s%s): chunk size "
                    "%d tokens, CPU pool %s, GPU tier %s, %d copy threads, %s", __version__,
                    config.bind_url, config.runtime_dir,
                    f", group {config.socket_group}" if config.socket_group else "",
                    config.chunk_size, format_size(parts.pool.capacity),
                    format_size(parts.gpu_pool.capacity) if parts.gpu_pool is not None
                    else "off", config.copy_threads,
                    f"CUDA on {torch.cuda.device_count()} GPUs (cuda_ipc handles accepted)"
                    if has_cuda else "no CUDA (memfd handles only)")
        if parts.l2 is not None:
            logger.info("L2: %s (budget %s, TTL %d s, write-behind queue %s, LOOKUP waits up "
                        "to %g s for it; %s)", parts.l2.describe(),
                        format_size(config.l2_budget) if config.l2_budget else "unlimited",
                        config.l2_ttl, format_size(config.l2_queue_size),
                        config.l2_prefetch_wait, parts.l2.values.describe())
            if config.l2_key_file is None:
                logger.warning("L2 values are not signed: anyone who can write to %s can "
                               "change what engines load from it; give every server that "
                               "shares it the same --l2-key-file (docs/l2.md, Trust)",
                               parts.l2.describe())
        if parts.disk is not None:
            logger.info("disk tier: %s, %s (write-through queue %s, LOOKUP waits up to %g s "
                        "for its reads)", parts.disk.describe(), format_size(config.disk_size
                                                                             or 0),
                        format_size(config.disk_queue_size), config.disk_prefetch_wait)
        if config.bind_url.startswith("tcp://"):
            logger.warning("%s is a TCP endpoint: any process that can reach it and holds the "
                           "engine token can use the cache; keep the token file private",
                           config.bind_url)

    # -- the HTTP endpoint (--metrics-port) ----------------------------------------------

    def _open_http_endpoint(self, loop: asyncio.AbstractEventLoop) -> HttpEndpoint:
        config = self.config
        labels = TenantLabels(dict(config.tenant_label), self.parts.label_key,
                              config.metrics_tenants)
        try:
            endpoint = HttpEndpoint(config.metrics_host, config.metrics_port,
                                    exposition(lambda: self._snapshot_from_loop(loop), labels),
                                    self._loop_problem, self._unready_reason)
        except OSError as exc:
            raise OSError(exc.errno, f"metrics endpoint {config.metrics_host}:"
                                     f"{config.metrics_port}: {exc.strerror}") from None
        endpoint.start()
        logger.info("metrics on http://%s:%d/metrics, probes /healthz and /readyz",
                    *endpoint.address)
        return endpoint

    def _snapshot_from_loop(self, loop: asyncio.AbstractEventLoop) -> protocol.StatsReply:
        """STATS as an admin sees it (called from the HTTP thread): the figures are taken on
        the loop, the tenants listed on this thread from the salts listed there."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def build() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self.parts.dispatcher.snapshot_without_tenants())
                except Exception as exc:
                    future.set_exception(exc)
        try:
            loop.call_soon_threadsafe(build)
            reply, tenants = future.result(timeout=self.config.loop_stall_timeout)
        except (RuntimeError, concurrent.futures.TimeoutError):  # the loop is closed or stuck
            future.cancel()
            raise Unavailable(f"the event loop did not answer in "
                              f"{self.config.loop_stall_timeout:g} s") from None
        reply.tenants = tenants()
        return reply

    def _loop_problem(self) -> str | None:
        """For /healthz: whether the loop turns."""
        stalled = self._loop_watch.stalled_for()
        if stalled > self.config.loop_stall_timeout:
            return f"the event loop has not turned for {stalled:.1f} s"
        return None

    def _unready_reason(self) -> str | None:
        """For /readyz: whether new requests are welcome."""
        if self.should_exit:
            return "shutting down"
        if not self.parts.pool.prefault_done.is_set():
            return "the pool is being faulted in"
        return None

    # -- housekeeping ----------------------------------------------------------------------

    async def _housekeeping_loop(self) -> None:
        parts = self.parts
        store, registry = parts.store, parts.registry
        refused_logged, refusals_log_after = 0, 0.0
        while True:
            await asyncio.sleep(_HOUSEKEEPING_S)
            expired = 0

            def expire_slice() -> bool:
                nonlocal expired
                expiring = store.expire_leases(_LEASE_EXPIRY_SLICE)
                expired += expiring
                return expiring < _LEASE_EXPIRY_SLICE
            if not expire_slice():  # many at once: the rest in turn with long requests' slices
                await parts.dispatcher.slices.run(expire_slice)
            if expired:
                logger.info("%d leases expired", expired)
            # Engines that fill the lease table may keep doing so: a line a minute at most.
            if store.holds_refused > refused_logged and time.monotonic() >= refusals_log_after:
                logger.warning("%d LOOKUP holds not taken: %d leases hold %d chunks, at the "
                               "server-wide limits (MAX_LEASES, MAX_LEASED_CHUNKS); those "
                               "chunks stay evictable", store.holds_refused - refused_logged,
                               store.leases_held, store.leased_chunks)
                refused_logged = store.holds_refused
                refusals_log_after = time.monotonic() + _REFUSALS_LOG_INTERVAL_S
            for instance_id in registry.expired(self.config.worker_timeout):
                logger.warning("instance %d: no message for %g s, dropping its registration",
                               instance_id, self.config.worker_timeout)
                registry.unregister(instance_id)
            parts.sessions.expire(busy=registry.owns_any)
            expired = parts.fd_channel.expire()
            if expired:
                logger.info("%d fd channel tickets or watches expired unused", expired)

    # -- shutdown --------------------------------------------------------------------------

    async def shutdown(self) -> None:
        parts = self.parts
        router = parts.router
        loop = asyncio.get_running_loop()
        # Requests in flight and the disk tier's queue share the drain's time.
        drained_by = loop.time() + self.config.shutdown_timeout
        logger.info("shutdown: refusing new requests, %d in flight", len(router.in_flight))
        router.refuse_new()
        if router.in_flight:
            await asyncio.wait(list(router.in_flight), timeout=self.config.shutdown_timeout)
        router.fail_in_flight()
        for tier in parts.lower:
            if not await tier.close(max(0.0, drained_by - loop.time())):
                self._abandoned = True
        logger.info("shutdown: waiting for running copies")
        parts.copy_engine.shutdown()
        if parts.copier is not None:
            parts.copier.shutdown()
        if router.in_flight:  # told already; no copy runs for them any more
            _, stuck = await asyncio.wait(list(router.in_flight), timeout=_STUCK_REQUESTS_S)
            if stuck:
                logger.warning("shutdown: %d requests still waiting after the copies ended; "
                               "cancelling them", len(stuck))
                for task in stuck:
                    task.cancel()
                await asyncio.wait(stuck, timeout=_STUCK_REQUESTS_S)
        await router.refuse_stragglers()
        for task in self._background:
            task.cancel()
        self._collector_guard.uninstall()
        router.close()
        logger.info("shutdown: releasing %d registrations", len(parts.registry))
        for instance_id in parts.registry.instance_ids():
            parts.registry.unregister(instance_id)
        runtime.unlink_ipc_endpoint(self.config.bind_url)
        parts.fd_channel.close()
        if parts.warm is not None:
            parts.warm.save(parts.store, parts.pool)
            parts.warm.close()
        parts.pool.close()
        if parts.warm is None:  # a segment's pages stay in its file, for the next server
            # The process's exit would free them too, after the last line here: seconds of
            # a large pool in 4 KiB pages (about 0.7 s a GiB on a busy 2-core machine).
            logger.info("shutdown: giving the CPU pool's %s back to the system",
                        format_size(parts.pool.capacity))
            await loop.run_in_executor(None, parts.pool.give_back)
        if self._http is not None:  # last: /readyz says "shutting down" until the end
            self._http.close()
        logger.info("shutdown: done")
