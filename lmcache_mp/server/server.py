"""The server lifecycle: signals, start-up, the ROUTER socket loop, housekeeping and shutdown."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import time
from collections.abc import Awaitable
from dataclasses import dataclass

import torch
import uvloop
import zmq

from .. import __version__, cuda, protocol
from ..errors import InternalError, ServerError, ShuttingDown
from ..sizes import format_size
from .config import Config
from .copy_engine import CopyEngine
from .cuda_ipc import CudaIpcSupport, SharedAllocations
from .device import CudaDevice
from .dispatcher import Dispatcher
from .pool import CpuPool, DevicePool
from .quotas import QuotaError
from .registry import Registry
from .store import ChunkStore
from .streams import StreamCopier

logger = logging.getLogger("lmcache_mp.server")

_MAX_MESSAGES_PER_WAKE = 64
_HOUSEKEEPING_S = 0.5
_GPU_COPY_TIMEOUT_S = 60.0  # one request's device work; a GPU that takes longer has failed


@dataclass(frozen=True)
class _InFlight:
    client: bytes
    request_id: int


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
        self._pool: CpuPool | None = None
        self._copy_engine: CopyEngine | None = None
        self._copier: StreamCopier | None = None
        self._in_flight: dict[asyncio.Task, _InFlight] = {}
        self._answered: set[asyncio.Task] = set()
        self._housekeeping: asyncio.Task | None = None

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

    async def startup(self) -> None:
        config = self.config
        # Parallelism comes from the copy threads; torch's own pool would oversubscribe the cores.
        torch.set_num_threads(1)
        has_cuda = torch.cuda.is_available()
        self._pool = CpuPool(config.cpu_size, pin=has_cuda)
        gpu_pool = DevicePool(config.gpu_size, torch.device("cuda", 0)) if config.gpu_size else None
        gpu_allocator = gpu_pool.allocator if gpu_pool is not None else None
        capacity = self._pool.capacity + (gpu_pool.capacity if gpu_pool is not None else 0)
        store = ChunkStore(self._pool.allocator, config.lease_timeout,
                           config.quota_book(capacity), gpu_allocator=gpu_allocator)
        self._pool.start_prefault()
        cuda_ipc = None
        if has_cuda:
            self._copier = StreamCopier(CudaDevice(), config.copy_threads, _GPU_COPY_TIMEOUT_S)
            cuda_ipc = CudaIpcSupport(SharedAllocations(cuda.open_allocation).open,
                                      cuda.device_index, self._copier.new_lane)
        registry = Registry(config.chunk_size, time.monotonic, cuda_ipc)
        self._copy_engine = CopyEngine(config.copy_threads)
        self.dispatcher = Dispatcher(config, store, self._pool, registry, self._copy_engine,
                                     push=self._push, copier=self._copier, gpu_pool=gpu_pool)
        self._exit_requested = asyncio.Event()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        self._socket.bind(config.bind_url)
        # A plain socket driven by the loop's reader callback: zmq.asyncio's futures cost
        # more than a whole LOOKUP.
        asyncio.get_running_loop().add_reader(self._socket.FD, self._drain)
        self._housekeeping = asyncio.create_task(self._housekeeping_loop())
        logger.info("lmcache-mp-server %s serving on %s: chunk size %d tokens, CPU pool %s, "
                    "GPU tier %s, %d copy threads, %s", __version__, config.bind_url,
                    config.chunk_size, format_size(self._pool.capacity),
                    format_size(gpu_pool.capacity) if gpu_pool is not None else "off",
                    config.copy_threads,
                    f"CUDA on {torch.cuda.device_count()} GPUs (cuda_ipc handles accepted)"
                    if has_cuda else "no CUDA (shm handles only)")

    async def main_loop(self) -> None:
        await self._exit_requested.wait()

    def _drain(self) -> None:
        """Handle what has arrived. ZeroMQ's FD is edge-triggered: keep going until EVENTS is empty."""
        socket = self._socket
        for _ in range(_MAX_MESSAGES_PER_WAKE):
            if not socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            self._on_message(socket.recv_multipart(zmq.NOBLOCK))
        # More is waiting: yield to replies and copies, then come back.
        asyncio.get_running_loop().call_soon(self._drain)

    def _dispatch(self, frames: list[bytes]) -> None:
        client, body = frames[0], frames[1:]
        request_id = protocol.request_id_of(body)
        try:
            parsed = protocol.parse_request_frames(body)
            request = protocol.unpack(protocol.OPS[parsed.op].request, parsed.payload)
            result = self.dispatcher.handle(client, parsed.op, request)
            if not inspect.isawaitable(result):
                reply = protocol.reply_frames(request_id, result)
        except Exception as exc:
            self._send_error(client, request_id, exc)
            return
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(self._finish(client, request_id, result))
            self._in_flight[task] = _InFlight(client, request_id)
            task.add_done_callback(self._forget)
        else:
            self._send(client, reply)

    async def _finish(self, client: bytes, request_id: int, pending: Awaitable) -> None:
        try:
            reply = protocol.reply_frames(request_id, await pending)
        except Exception as exc:
            if asyncio.current_task() not in self._answered:
                self._send_error(client, request_id, exc)
            return
        if asyncio.current_task() not in self._answered:
            self._send(client, reply)

    def _forget(self, task: asyncio.Task) -> None:
        self._in_flight.pop(task, None)
        self._answered.discard(task)

    def _push(self, client: bytes, message: object) -> None:
        self._send(client, protocol.push_frames(message))

    def _send_error(self, client: bytes, request_id: int, exc: BaseException) -> None:
        if not isinstance(exc, ServerError):
            logger.exception("request %d failed", request_id, exc_info=exc)
            exc = InternalError(f"internal error: {type(exc).__name__}: {exc}")
        else:
            logger.debug("request %d refused: %s: %s", request_id, exc.code, exc)
        self._send(client, protocol.error_frames(request_id, exc.code, str(exc)))

    def _send(self, client: bytes, frames: list[bytes]) -> None:
        try:
            self._socket.send_multipart([client, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the client is gone or not reading: its loss, not ours
            logger.debug("dropping reply to a client: %s", exc)
        # A send can consume the FD's edge for messages that arrived meanwhile.
        if self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            asyncio.get_running_loop().call_soon(self._drain)

    async def _housekeeping_loop(self) -> None:
        dispatcher = self.dispatcher
        while True:
            await asyncio.sleep(_HOUSEKEEPING_S)
            expired = dispatcher.store.expire_leases()
            if expired:
                logger.info("%d leases expired", expired)
            for instance_id in dispatcher.registry.expired(self.config.worker_timeout):
                logger.warning("instance %d: no message for %g s, dropping its registration",
                               instance_id, self.config.worker_timeout)
                dispatcher.registry.unregister(instance_id)

    def _refuse(self, frames: list[bytes]) -> None:
        self._send_error(frames[0], protocol.request_id_of(frames[1:]),
                         ShuttingDown("the server is shutting down"))

    async def shutdown(self) -> None:
        logger.info("shutdown: refusing new requests, %d in flight", len(self._in_flight))
        self._on_message = self._refuse
        self._drain()
        if self._in_flight:
            await asyncio.wait(list(self._in_flight), timeout=self.config.shutdown_timeout)
        for task, pending in list(self._in_flight.items()):
            self._answered.add(task)
            self._send_error(pending.client, pending.request_id,
                                   ShuttingDown("the server shut down before this request finished"))
        logger.info("shutdown: waiting for running copies")
        self._copy_engine.shutdown()
        if self._copier is not None:
            self._copier.shutdown()
        if self._in_flight:
            await asyncio.wait(list(self._in_flight))
        self._housekeeping.cancel()
        asyncio.get_running_loop().remove_reader(self._socket.FD)
        logger.info("shutdown: releasing %d registrations", len(self.dispatcher.registry))
        for instance_id in self.dispatcher.registry.instance_ids():
            self.dispatcher.registry.unregister(instance_id)
        self._socket.close(linger=0)
        self._context.term()
        self._pool.close()
        logger.info("shutdown: done")
