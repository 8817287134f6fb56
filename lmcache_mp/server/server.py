"""The server lifecycle: signals, start-up, the ROUTER socket loop, housekeeping and shutdown."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import gc
import logging
import os
import resource
import signal
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path

import torch
import uvloop
import zmq

from .. import __version__, cuda, phases, protocol, runtime
from ..errors import InternalError, ServerError, ShuttingDown
from ..sizes import format_size
from ..zmq_io import readable, recv_message, send_frames
from .access import Sessions, load_or_create_token, prepare_runtime_dir, read_token_file
from .collector import CollectorGuard
from .config import Config
from .copy_engine import CopyEngine
from .cuda_ipc import CudaIpcSupport, SharedAllocations
from .device import CudaDevice
from .dispatcher import Dispatcher
from .exporter import TenantLabels, exposition
from .fd_channel import FdChannel
from .http_endpoint import HttpEndpoint, Unavailable
from .loop_watch import LoopWatch
from .metrics import OK, ServerMetrics
from .pool import CpuPool, CudaPinner, DevicePool
from .quotas import QuotaError
from .registry import Registry
from .store import GPU_TIER, ChunkStore
from .streams import StreamCopier
from .warm import KEY_NAME, WarmStart

logger = logging.getLogger("lmcache_mp.server")

_MAX_MESSAGES_PER_WAKE = 64
_HOUSEKEEPING_S = 0.5
# Leases released at a time when many expire together (~1 ms of the loop on 2 cores).
_LEASE_EXPIRY_SLICE = 256
_REFUSALS_LOG_INTERVAL_S = 60.0  # the least time between two lines about holds not taken
_BACKLOG_RETRY_S = 0.002  # how soon replies a slow reader could not take are offered again
_GPU_COPY_TIMEOUT_S = 60.0  # one request's device work; a GPU that takes longer has failed
_STUCK_REQUESTS_S = 2.0  # at shutdown, once copies ended: what requests still waiting get
# At shutdown, before the socket closes: how long it must have been quiet (nothing new
# to refuse, no reply waiting for a slow reader), and the most time spent on that.
_STRAGGLERS_QUIET_S = 0.05
_STRAGGLERS_S = 2.0
_LINGER_MS = 1000  # then, how long replies already queued in ZeroMQ may take to leave


@dataclass(frozen=True)
class _InFlight:
    client: bytes
    request_id: int
    op: str
    started: float  # time.perf_counter() when it arrived


def _op_of(body: list[bytes]) -> str:
    """The op a request names, or `invalid` (a metrics label: never what a client wrote)."""
    try:
        return protocol.parse_request_frames(body).op
    except Exception:
        return "invalid"


class Server:
    """serve() = install signal handlers → startup() → main_loop() → shutdown()."""

    def __init__(self, config: Config):
        self.config = config
        self.should_exit = False
        self.dispatcher: Dispatcher | None = None
        self._exit_requested: asyncio.Event | None = None
        self._socket: zmq.Socket | None = None
        self._context: zmq.Context | None = None
        self._on_message = self._dispatch
        self._draining = False  # inside _drain()
        self._refused = 0  # requests answered shutting_down
        self._pool: CpuPool | None = None
        self._copy_engine: CopyEngine | None = None
        self._copier: StreamCopier | None = None
        self._in_flight: dict[asyncio.Task, _InFlight] = {}
        self._answered: set[asyncio.Task] = set()
        self._housekeeping: asyncio.Task | None = None
        self._fd_channel: FdChannel | None = None
        self._sessions: Sessions | None = None
        self._l2 = None  # the L2 tier (--l2): lmcache_mp.server.l2.tier.L2Tier
        self._warm: WarmStart | None = None  # the named pool segment (--pool-segment)
        # Replies ZeroMQ could not take yet (the client reads slowly), in order, per client.
        self._backlog: dict[bytes, deque[list[bytes]]] = {}
        self._backlog_bytes: dict[bytes, int] = {}
        self._backlog_retry: asyncio.TimerHandle | None = None
        self.metrics = ServerMetrics()
        self._loop_watch = LoopWatch(self.metrics)
        self._loop_watch_task: asyncio.Task | None = None
        self._collector_guard = CollectorGuard()
        self._http: HttpEndpoint | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._label_key = b""  # keys the tenant labels' digests: the admin token

    def run(self) -> None:
        uvloop.run(self.serve())

    async def serve(self) -> None:
        self.install_signal_handlers()
        await self.startup()
        await self.main_loop()
        await self.shutdown()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._handle_exit, sig)
        loop.add_signal_handler(signal.SIGHUP, self._reload_quotas)

    def _reload_quotas(self) -> None:
        if self.dispatcher is None:
            logger.warning("SIGHUP before start-up finished: ignored")
            return
        try:
            self.dispatcher.reload_quota_file()
        except QuotaError as exc:
            logger.error("SIGHUP: quotas not reloaded, the old ones stay: %s", exc)
            return
        logger.info("SIGHUP: reloaded quotas from %s", self.config.quota_file)

    def _handle_exit(self, sig: signal.Signals) -> None:
        if self.should_exit:
            logger.warning("second %s: exiting now", sig.name)
            os._exit(1)
        logger.info("%s received: draining (up to %.0f s); send it again to exit at once",
                    sig.name, self.config.shutdown_timeout)
        self.should_exit = True
        self._exit_requested.set()

    def _open_access(self) -> tuple[Sessions, FdChannel]:
        """The runtime directory, the tokens and the fd channel; raises AccessError."""
        config = self.config
        gid = config.socket_gid
        directory = Path(config.runtime_dir)
        prepare_runtime_dir(directory, gid)
        shared_mode = 0o640 if gid is not None else 0o600
        engine_token = (read_token_file(Path(config.token_file)) if config.token_file else
                        load_or_create_token(directory / runtime.TOKEN_NAME, shared_mode, gid))
        admin_token = (read_token_file(Path(config.admin_token_file), 0o600)
                       if config.admin_token_file else
                       load_or_create_token(directory / runtime.ADMIN_TOKEN_NAME, 0o600, None))
        # Only a socket file has permissions to decide who connects: tcp:// and abstract
        # ipc://@ sockets need the token.
        path_socket = (config.bind_url.startswith("ipc://")
                       and not config.bind_url.startswith("ipc://@"))
        sessions = Sessions(engine_token, admin_token, token_required=not path_socket)
        self._label_key = admin_token.encode()
        channel = FdChannel(str(directory / runtime.FD_SOCKET_NAME),
                            0o660 if gid is not None else 0o600, gid, bindings=sessions.bound)
        return sessions, channel

    async def startup(self) -> None:
        config = self.config
        # Every connection and registration costs a descriptor: take all the system allows.
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        self._sessions, self._fd_channel = self._open_access()
        # Parallelism comes from the copy threads; torch's own pool would oversubscribe the cores.
        torch.set_num_threads(1)
        has_cuda = torch.cuda.is_available()
        segment = None
        if config.pool_segment is not None:
            # The key that signs snapshots lives apart from them, in the runtime directory:
            # whoever can write /dev/shm (a container sharing it, say) cannot read it.
            key = load_or_create_token(Path(config.runtime_dir) / KEY_NAME, 0o600, None)
            self._warm = WarmStart(config.pool_segment, config.cpu_size, config.chunk_size,
                                   key.encode(), config.adopt,
                                   Path(config.pool_segment_dir) if config.pool_segment_dir
                                   else None, config.copy_threads)
            segment = self._warm.open()
        self._pool = CpuPool(config.cpu_size, CudaPinner() if has_cuda else None, segment)
        gpu_pool = DevicePool(config.gpu_size, torch.device("cuda", 0)) if config.gpu_size else None
        gpu_allocator = gpu_pool.allocator if gpu_pool is not None else None
        capacity = self._pool.capacity + (gpu_pool.capacity if gpu_pool is not None else 0)
        store = ChunkStore(self._pool.allocator, config.lease_timeout,
                           config.quota_book(capacity), gpu_allocator=gpu_allocator)
        if self._warm is not None:
            if self._warm.cold_reason is None:
                logger.info("warm start: adopted %d chunks from %s",
                            self._warm.adopt(store, self._pool), self._warm.pool_path)
            else:
                logger.info("cold start in %s: %s", self._warm.pool_path,
                            self._warm.cold_reason)
        self._pool.start_prefault()
        cuda_ipc = None
        if has_cuda:
            self._copier = StreamCopier(CudaDevice(), config.copy_threads, _GPU_COPY_TIMEOUT_S)
            cuda_ipc = CudaIpcSupport(SharedAllocations(cuda.open_allocation).open,
                                      cuda.device_index, self._copier.new_lane)
        registry = Registry(config.chunk_size, time.monotonic, self._fd_channel, cuda_ipc,
                            self._fd_channel.watch)
        self._copy_engine = CopyEngine(config.copy_threads)
        if config.l2 is not None:
            from .l2.tier import L2Tier  # redis-py is needed only with --l2
            self._l2 = L2Tier.from_config(config, store, registry, self._pool, lambda chunk: (
                gpu_pool if chunk.tier == GPU_TIER else self._pool).view(chunk.offset,
                                                                          chunk.nbytes))
            self._l2.start()
        self.dispatcher = Dispatcher(config, store, self._pool, registry, self._copy_engine,
                                     self._sessions, self._fd_channel.path, push=self._push,
                                     copier=self._copier, gpu_pool=gpu_pool,
                                     metrics=self.metrics, l2=self._l2)
        self._exit_requested = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._fd_channel.start(loop)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        # A full pipe to a client raises instead of dropping the reply: see _send.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # The socket file is born with no permission for others, not chmod-ed a moment later.
        umask = os.umask(0o117 if config.socket_gid is not None else 0o177)
        try:
            self._socket.bind(config.bind_url)
        finally:
            os.umask(umask)
        if config.bind_url.startswith("ipc://") and not config.bind_url.startswith("ipc://@"):
            socket_path = config.bind_url.removeprefix("ipc://")
            if config.socket_gid is not None:
                os.chown(socket_path, -1, config.socket_gid)
        # A plain socket driven by the loop's reader callback: zmq.asyncio's futures cost
        # more than a whole LOOKUP.
        loop.add_reader(self._socket.FD, self._drain)
        self._housekeeping = asyncio.create_task(self._housekeeping_loop())
        self._loop = loop
        self._loop_watch_task = asyncio.create_task(self._loop_watch.run())
        if config.metrics_port:
            self._http = self._open_http_endpoint()
        # Everything built so far (torch's modules above all) lives as long as the process:
        # out of the collector's sight, a full collection costs ~0.2 ms instead of ~100 ms,
        # which a request allocating a few thousand keys would otherwise trigger. What the
        # store keeps later is frozen likewise, once a full collection grows long.
        gc.freeze()
        self._collector_guard.install()
        logger.info("lmcache-mp-server %s serving on %s (runtime directory %s%s): chunk size "
                    "%d tokens, CPU pool %s, GPU tier %s, %d copy threads, %s", __version__,
                    config.bind_url, config.runtime_dir,
                    f", group {config.socket_group}" if config.socket_group else "",
                    config.chunk_size, format_size(self._pool.capacity),
                    format_size(gpu_pool.capacity) if gpu_pool is not None else "off",
                    config.copy_threads,
                    f"CUDA on {torch.cuda.device_count()} GPUs (cuda_ipc handles accepted)"
                    if has_cuda else "no CUDA (memfd handles only)")
        if self._l2 is not None:
            logger.info("L2: %s (budget %s, TTL %d s, write-behind queue %s, LOOKUP waits up "
                        "to %g s for it; %s)", self._l2.describe(),
                        format_size(config.l2_budget) if config.l2_budget else "unlimited",
                        config.l2_ttl, format_size(config.l2_queue_size),
                        config.l2_prefetch_wait, self._l2.values.describe())
            if config.l2_key_file is None:
                logger.warning("L2 values are not signed: anyone who can write to %s can "
                               "change what engines load from it; give every server that "
                               "shares it the same --l2-key-file (docs/l2.md, Trust)",
                               self._l2.describe())
        if config.bind_url.startswith("tcp://"):
            logger.warning("%s is a TCP endpoint: any process that can reach it and holds the "
                           "engine token can use the cache; keep the token file private",
                           config.bind_url)

    def _open_http_endpoint(self) -> HttpEndpoint:
        config = self.config
        labels = TenantLabels(dict(config.tenant_label), self._label_key, config.metrics_tenants)
        try:
            endpoint = HttpEndpoint(config.metrics_host, config.metrics_port,
                                    exposition(self._snapshot_from_loop, labels),
                                    self._loop_problem, self._unready_reason)
        except OSError as exc:
            raise OSError(exc.errno, f"metrics endpoint {config.metrics_host}:"
                                     f"{config.metrics_port}: {exc.strerror}") from None
        endpoint.start()
        logger.info("metrics on http://%s:%d/metrics, probes /healthz and /readyz",
                    *endpoint.address)
        return endpoint

    def _snapshot_from_loop(self) -> protocol.StatsReply:
        """STATS as an admin sees it (called from the HTTP thread): the figures are taken on
        the loop, the tenants listed on this thread from the salts listed there."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def build() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self.dispatcher.snapshot_without_tenants())
                except Exception as exc:
                    future.set_exception(exc)
        try:
            self._loop.call_soon_threadsafe(build)
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
        if not self._pool.prefault_done.is_set():
            return "the pool is being faulted in"
        return None

    async def main_loop(self) -> None:
        await self._exit_requested.wait()

    def _drain(self) -> None:
        """Handle what has arrived. ZeroMQ's FD is edge-triggered: keep going until EVENTS is empty."""
        socket = self._socket
        self._draining = True  # its own loop reads what a reply's send left behind
        try:
            for read in range(_MAX_MESSAGES_PER_WAKE):
                # The FD nearly always wakes the loop for a message (>99% in a run of
                # LOOKUPs): the first is read without a test (a zmq_poll), at the price of
                # an exception when it woke for ZeroMQ's own commands.
                if read and not readable(socket):
                    return
                try:
                    first, frames = recv_message(socket)
                except zmq.Again:
                    return
                self._on_message(frames, first)
        finally:
            self._draining = False
        # More is waiting: yield to replies and copies, then come back.
        asyncio.get_running_loop().call_soon(self._drain)

    def _dispatch(self, frames: list[bytes], first: zmq.Frame) -> None:
        """Serve one request; `first`: its first frame, which says who sent it (HELLO)."""
        started = time.perf_counter()
        timing = phases.enabled  # its stamps are Python calls: ~3% of a LOOKUP's own work
        stamp = phases.now() if timing else 0
        client, body = frames[0], frames[1:]
        request_id = op = None
        try:
            request_id, op, payload = protocol.parse_request_frames(body)
            # Who may send it is known from the frames: no decoding for those who may not.
            session = self.dispatcher.admit(client, op)
            request = protocol.unpack(protocol.OPS[op].request, payload, bounded=True)
            if timing:
                stamp = phases.add(op, "server decode", stamp)
            result = self.dispatcher.serve(client, op, request, session, first)
            if timing:
                stamp = phases.add(op, "server handle", stamp)
            # inspect.isawaitable(), less its three Python calls: a coroutine or a Future.
            awaitable = hasattr(result, "__await__")
            if not awaitable:
                reply = protocol.reply_frames(request_id, result)
                if timing:
                    phases.add(op, "server reply", stamp)
        except Exception as exc:
            if op is None:  # the frames did not parse
                request_id, op = protocol.request_id_of(body), "invalid"
            self._send_error(client, request_id, exc, op, started)
        else:
            if awaitable:
                pending = _InFlight(client, request_id, op, started)
                task = asyncio.ensure_future(self._finish(pending, result))
                self._in_flight[task] = pending
                task.add_done_callback(self._forget)
            else:
                self._send(client, reply)
                self.metrics.answered(op, OK, time.perf_counter() - started)
        # Any request that names a known op counts, and is a sign of life, even when its
        # payload was refused: noted once its reply is on its way, off the round trip.
        if op != "invalid":
            self.dispatcher.note_request(client, op)

    async def _finish(self, pending: _InFlight, result: Awaitable) -> None:
        try:
            value = await result
            stamp = phases.now()
            reply = protocol.reply_frames(pending.request_id, value)
            phases.add(pending.op, "server reply", stamp)
        except Exception as exc:
            if asyncio.current_task() not in self._answered:
                self._send_error(pending.client, pending.request_id, exc, pending.op,
                                 pending.started)
            return
        if asyncio.current_task() not in self._answered:
            self._send(pending.client, reply)
            self.metrics.answered(pending.op, OK, time.perf_counter() - pending.started)

    def _forget(self, task: asyncio.Task) -> None:
        self._in_flight.pop(task, None)
        self._answered.discard(task)

    def _push(self, client: bytes, message: object) -> None:
        self._send(client, protocol.push_frames(message))

    def _send_error(self, client: bytes, request_id: int, exc: BaseException, op: str,
                    started: float) -> None:
        code = exc.code if isinstance(exc, ServerError) else InternalError.code
        fields = dict(request_id=request_id, op=op, client=client.hex(), outcome=code)
        if not isinstance(exc, ServerError):
            logger.error("request %d (%s) failed", request_id, op, exc_info=exc, extra=fields)
            # The first line only: the log has the rest (torch's errors carry C++ frames).
            summary = str(exc).strip().split("\n", 1)[0][:200]
            exc = InternalError(f"internal error: {type(exc).__name__}: {summary}")
        else:
            logger.debug("request %d (%s) refused: %s: %s", request_id, op, code, exc,
                         extra=fields)
        self._send(client, protocol.error_frames(request_id, code, str(exc)))
        self.metrics.answered(op, code, time.perf_counter() - started)

    def _send(self, client: bytes, frames: list[bytes]) -> None:
        """Send, or keep in the client's backlog while ZeroMQ's pipe to it is full: no reply
        is ever dropped for a client that reads, however late."""
        backlog = self._backlog.get(client)
        if backlog is not None:
            self._keep(client, backlog, frames)
        else:
            try:
                send_frames(self._socket, [client, *frames])
            except zmq.Again:
                backlog = self._backlog[client] = deque()
                self._backlog_bytes[client] = 0
                self._keep(client, backlog, frames)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the client is gone; its loss only
                logger.debug("dropping a reply to a client that left: %s", exc)
        self._drain_if_pending()

    def _drain_if_pending(self) -> None:
        # A send can consume the FD's edge for messages that arrived meanwhile.
        if not self._draining and readable(self._socket):
            asyncio.get_running_loop().call_soon(self._drain)

    def _keep(self, client: bytes, backlog: deque[list[bytes]], frames: list[bytes]) -> None:
        size = sum(len(frame) for frame in frames)
        if self._backlog_bytes[client] + size > protocol.REPLY_BACKLOG_BYTES:
            # It stopped reading: free what it left, and end its session so that its next
            # request learns why (unauthenticated, naming the backlog) before HELLO again.
            logger.warning("a client left over %d bytes of replies unread: dropping them and "
                           "its session", protocol.REPLY_BACKLOG_BYTES)
            del self._backlog[client], self._backlog_bytes[client]
            self._sessions.drop(client, reason=f"it left more than "
                                f"{protocol.REPLY_BACKLOG_BYTES} bytes of replies unread")
            return
        backlog.append(frames)
        self._backlog_bytes[client] += size
        if self._backlog_retry is None:
            self._backlog_retry = asyncio.get_running_loop().call_later(
                _BACKLOG_RETRY_S, self._flush_backlogs)

    def _flush_backlogs(self) -> None:
        self._backlog_retry = None
        for client in list(self._backlog):
            backlog = self._backlog[client]
            while backlog:
                try:
                    send_frames(self._socket, [client, *backlog[0]])
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != errno.EHOSTUNREACH:
                        raise
                    backlog.clear()
                    break
                self._backlog_bytes[client] -= sum(len(frame) for frame in backlog.popleft())
            if not backlog:
                del self._backlog[client], self._backlog_bytes[client]
        if self._backlog:
            self._backlog_retry = asyncio.get_running_loop().call_later(
                _BACKLOG_RETRY_S, self._flush_backlogs)
        self._drain_if_pending()

    async def _housekeeping_loop(self) -> None:
        dispatcher = self.dispatcher
        refused_logged, refusals_log_after = 0, 0.0
        while True:
            await asyncio.sleep(_HOUSEKEEPING_S)
            store = dispatcher.store
            expired = 0

            def expire_slice() -> bool:
                nonlocal expired
                expiring = store.expire_leases(_LEASE_EXPIRY_SLICE)
                expired += expiring
                return expiring < _LEASE_EXPIRY_SLICE
            if not expire_slice():  # many at once: the rest in turn with long requests' slices
                await dispatcher.slices.run(expire_slice)
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
            for instance_id in dispatcher.registry.expired(self.config.worker_timeout):
                logger.warning("instance %d: no message for %g s, dropping its registration",
                               instance_id, self.config.worker_timeout)
                dispatcher.registry.unregister(instance_id)
            self._sessions.expire(busy=dispatcher.registry.owns_any)
            expired = self._fd_channel.expire()
            if expired:
                logger.info("%d fd channel tickets or watches expired unused", expired)

    def _refuse(self, frames: list[bytes], _first: zmq.Frame) -> None:
        self._refused += 1
        self._send_error(frames[0], protocol.request_id_of(frames[1:]),
                         ShuttingDown("the server is shutting down"), _op_of(frames[1:]),
                         time.perf_counter())

    async def _refuse_stragglers(self) -> None:
        """Answer `shutting_down` to what clients sent before they could know, and hand
        slow readers the replies kept for them, until the socket has been quiet for
        _STRAGGLERS_QUIET_S (at most _STRAGGLERS_S): a request sent just before the signal
        may still be on its way through ZeroMQ's I/O thread, and a socket closed under it
        or under a backlog would leave those requests without a reply."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + _STRAGGLERS_S
        seen, quiet_since = self._refused, loop.time()
        while loop.time() < give_up:
            if readable(self._socket):
                self._drain()
            if self._refused != seen or self._backlog:
                seen, quiet_since = self._refused, loop.time()
            elif loop.time() - quiet_since >= _STRAGGLERS_QUIET_S:
                break
            await asyncio.sleep(_STRAGGLERS_QUIET_S / 5)
        if self._refused:
            logger.info("shutdown: %d requests that arrived while draining were answered "
                        "shutting_down", self._refused)
        if self._backlog:
            logger.warning("shutdown: %d clients did not read their last replies within "
                           "%g s; dropping them", len(self._backlog), _STRAGGLERS_S)

    async def shutdown(self) -> None:
        logger.info("shutdown: refusing new requests, %d in flight", len(self._in_flight))
        self._on_message = self._refuse
        self._drain()
        if self._in_flight:
            await asyncio.wait(list(self._in_flight), timeout=self.config.shutdown_timeout)
        for task, pending in list(self._in_flight.items()):
            self._answered.add(task)
            self._send_error(pending.client, pending.request_id,
                             ShuttingDown("the server shut down before this request finished"),
                             pending.op, pending.started)
        if self._l2 is not None:
            logger.info("shutdown: stopping L2 write-behind and prefetch")
            await self._l2.close()
        logger.info("shutdown: waiting for running copies")
        self._copy_engine.shutdown()
        if self._copier is not None:
            self._copier.shutdown()
        if self._in_flight:  # told already; no copy runs for them any more
            _, stuck = await asyncio.wait(list(self._in_flight), timeout=_STUCK_REQUESTS_S)
            if stuck:
                logger.warning("shutdown: %d requests still waiting after the copies ended; "
                               "cancelling them", len(stuck))
                for task in stuck:
                    task.cancel()
                await asyncio.wait(stuck, timeout=_STUCK_REQUESTS_S)
        await self._refuse_stragglers()
        self._housekeeping.cancel()
        self._loop_watch_task.cancel()
        self._collector_guard.uninstall()
        asyncio.get_running_loop().remove_reader(self._socket.FD)
        logger.info("shutdown: releasing %d registrations", len(self.dispatcher.registry))
        for instance_id in self.dispatcher.registry.instance_ids():
            self.dispatcher.registry.unregister(instance_id)
        # Our socket, and any other this context made; replies queued in ZeroMQ still go
        # out for a moment (a reader that stopped reading does not hold the exit up longer).
        self._context.destroy(linger=_LINGER_MS)
        runtime.unlink_ipc_endpoint(self.config.bind_url)
        self._fd_channel.close()
        if self._warm is not None:
            self._warm.save(self.dispatcher.store, self._pool)
            self._warm.close()
        self._pool.close()
        if self._http is not None:  # last: /readyz says "shutting down" until the end
            self._http.close()
        logger.info("shutdown: done")
