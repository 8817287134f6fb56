"""GPU copies: a stream per registered worker; work is queued off the loop, completion polled on it.

A STORE queues, on its worker's stream: a wait on the worker's interprocess event, the
copies out of GPU-tier chunks being demoted from the bytes it is about to write, then per
chunk a gather of its blocks into a staging chunk on the GPU and one copy of that into
the (pinned) pool chunk or the GPU tier; then an event. A RETRIEVE queues per chunk the copy of the
pool chunk into the staging chunk and a scatter into the blocks, and for an MLA leader
a device-to-device copy into each follower's staging chunk and a scatter there, on the
follower's stream. The loop polls the events, so the dispatcher commits a STORE, and
answers a RETRIEVE, only once the device has finished: the loop never blocks, and
queueing (a few µs per kernel) runs on a thread of its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..protocol import SKIP_BLOCK
from .device import Device
from .registry import RAW_DTYPES, Geometry, KVCacheInstance, raw

logger = logging.getLogger(__name__)

# At least a millisecond: uvloop rounds timer delays to whole milliseconds, so a shorter
# one becomes call_soon, and the loop thread would spin on cudaEventQuery (a core, and the
# GIL the copy threads need). A copy found done costs at most _MAX_POLL_S of latency.
_FIRST_POLL_S = 1e-3
_MAX_POLL_S = 4e-3
_STALLED_POLL_S = 1.0

GatherJob = tuple[torch.Tensor, torch.Tensor]  # (block ids on the CPU, pool chunk)
ScatterJob = tuple[torch.Tensor, torch.Tensor, bool]  # (block ids, pool chunk, has skips)


class DeviceStalled(Exception):
    """Queued device work did not finish in time. Until it does, the memory it touches must
    stay as it is (no chunk freed, no mapping closed): pass that clean-up to after()."""

    def __init__(self, timeout: float, settled: asyncio.Future):
        super().__init__(f"the GPU copies did not finish within {timeout:g} s")
        self.settled = settled

    def after(self, cleanup: Callable[[], None]) -> None:
        """Run `cleanup` once the device has finished the work (never, if the server exits first)."""
        self.settled.add_done_callback(lambda future: None if future.cancelled() else cleanup())


@dataclass(eq=False)
class Lane:
    """One registered worker's stream, its staging chunk, and the event its STOREs wait on."""

    stream: Any
    staging: torch.Tensor  # one chunk, chunk-shaped, on the worker's device, as registry.raw
    store_event: Any | None
    lock: threading.Lock = field(default_factory=threading.Lock)  # one request queues at a time


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Small CPU index tensors onto `device` in one copy that does not wait for the stream:
    from pageable memory, CUDA would first wait for all the work queued on it."""
    if device.type != "cuda" or not tensors:
        return tensors
    sizes = [t.numel() for t in tensors]
    return list(torch.cat(tensors).pin_memory().to(device, non_blocking=True).split(sizes))


def _attempt(work: Callable[[], None]) -> BaseException | None:
    try:
        work()
    except Exception as exc:  # noqa: BLE001 (one bad chunk must not fail its neighbours)
        return exc
    return None


class StreamCopier:
    """Runs the GPU copies of every registration that has a Lane."""

    def __init__(self, device: Device, threads: int, timeout: float):
        """`timeout`: how long the loop waits for one request's device work."""
        self.device = device
        self.timeout = timeout
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lmcache-gpu")
        self._stalled: set[asyncio.Task] = set()

    def new_lane(self, device: torch.device, geometry: Geometry, store_event: bytes) -> Lane:
        """A registration's stream and staging chunk on `device`; `store_event` may be b""."""
        event = self.device.open_event(device, store_event) if store_event else None
        # Bytes, as integers of the cache's item size: the copies never look at the values.
        staging = torch.empty(geometry.chunk_shape, dtype=RAW_DTYPES[geometry.itemsize],
                              device=device)
        return Lane(self.device.new_stream(device), staging, event)

    async def store(self, instance: KVCacheInstance, jobs: Sequence[GatherJob],
                    moves: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
                    ) -> list[BaseException | None]:
        """Copy each job's blocks into its pool chunk, after the `moves` (destination,
        source): GPU-tier chunks being demoted out of the bytes these jobs write. Per move,
        then per job: None or what it raised. Returns once the device has finished; raises
        DeviceStalled after the timeout."""
        loop = asyncio.get_running_loop()
        errors, event = await loop.run_in_executor(self._executor, self._queue_store, instance,
                                                   jobs, moves)
        await self._settle([event])
        return errors

    def _queue_store(self, instance: KVCacheInstance, jobs: Sequence[GatherJob],
                     moves: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        device, lane = self.device, instance.lane
        with lane.lock, device.use(lane.stream):
            if lane.store_event is not None:
                device.wait(lane.stream, lane.store_event)
            errors = [_attempt(lambda dst=dst, src=src: dst.copy_(src, non_blocking=True))
                      for dst, src in moves]
            ids = _to_device([ids for ids, _ in jobs], lane.staging.device)
            errors += [_attempt(lambda ids=ids, chunk=chunk: self._gather(instance, ids, chunk))
                       for ids, (_, chunk) in zip(ids, jobs)]
            return errors, device.record(lane.stream)

    @staticmethod
    def _gather(instance: KVCacheInstance, block_ids: torch.Tensor, chunk: torch.Tensor) -> None:
        staging = instance.lane.staging
        instance.gather(block_ids, staging)
        raw(chunk).copy_(staging, non_blocking=True)

    async def retrieve(self, targets: Sequence[KVCacheInstance], jobs: Sequence[ScatterJob]
                       ) -> list[list[BaseException | None]]:
        """Copy each job's pool chunk into its blocks of every target (an MLA leader first,
        then its followers); per target, per job, None or what it raised. Returns once the
        device has finished; raises DeviceStalled after the timeout."""
        loop = asyncio.get_running_loop()
        errors, events = await loop.run_in_executor(self._executor, self._queue_retrieve,
                                                    targets, jobs)
        await self._settle(events)
        return errors

    def _queue_retrieve(self, targets: Sequence[KVCacheInstance], jobs: Sequence[ScatterJob]):
        device, leader = self.device, targets[0]
        lane = leader.lane
        errors: list[list[BaseException | None]] = [[] for _ in targets]
        # Which blocks each chunk writes is decided here, on the CPU: on a GPU it would wait.
        positions = [(ids != SKIP_BLOCK).nonzero().flatten() if skips else None
                     for ids, _, skips in jobs]
        written = [ids if where is None else ids[where]
                   for (ids, _, _), where in zip(jobs, positions)]
        with lane.lock, device.use(lane.stream):
            indices = _to_device(written + [p for p in positions if p is not None],
                                 lane.staging.device)
            block_ids, found = indices[:len(jobs)], iter(indices[len(jobs):])
            where_on_device = [None if p is None else next(found) for p in positions]
            for (_, chunk, _), ids, where in zip(jobs, block_ids, where_on_device):
                error = _attempt(lambda ids=ids, chunk=chunk, where=where:
                                 self._scatter(leader, ids, chunk, where))
                errors[0].append(error)
                for k, follower in enumerate(targets[1:], 1):
                    errors[k].append(error or _attempt(
                        lambda ids=ids, where=where, follower=follower:
                        self._fan_out(leader, follower, ids, where)))
            return errors, [device.record(target.lane.stream) for target in targets]

    @staticmethod
    def _scatter(leader: KVCacheInstance, block_ids: torch.Tensor, chunk: torch.Tensor,
                 positions: torch.Tensor | None) -> None:
        staging = leader.lane.staging
        staging.copy_(raw(chunk), non_blocking=True)
        leader.scatter_blocks(block_ids, staging, positions)

    def _fan_out(self, leader: KVCacheInstance, follower: KVCacheInstance,
                 block_ids: torch.Tensor, positions: torch.Tensor | None) -> None:
        """Device to device: the leader's staging chunk into a follower's blocks, ordered
        after the leader's copy, and before the leader's staging chunk is reused."""
        device, mine, theirs = self.device, leader.lane, follower.lane
        ready = device.record(mine.stream)
        with device.use(theirs.stream):
            device.wait(theirs.stream, ready)
            theirs.staging.copy_(mine.staging, non_blocking=True)
            follower.scatter_blocks(block_ids, theirs.staging, positions)
            done = device.record(theirs.stream)
        device.wait(mine.stream, done)

    async def _settle(self, events: list[Any]) -> None:
        """Poll until every event has completed, backing off up to _MAX_POLL_S."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        delay = _FIRST_POLL_S
        while not all(self.device.query(event) for event in events):
            if loop.time() >= deadline:
                logger.error("GPU copies still running after %g s; their memory stays reserved "
                             "until they finish", self.timeout)
                task = asyncio.ensure_future(self._outlast(events))
                self._stalled.add(task)
                task.add_done_callback(self._stalled.discard)
                raise DeviceStalled(self.timeout, task)
            await asyncio.sleep(delay)
            delay = min(2 * delay, _MAX_POLL_S)

    async def _outlast(self, events: list[Any]) -> None:
        while not all(self.device.query(event) for event in events):
            await asyncio.sleep(_STALLED_POLL_S)
        logger.info("stalled GPU copies finished; their memory is released")

    def shutdown(self) -> None:
        """Wait for queueing threads; stop watching stalled copies (the process is exiting)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        for task in list(self._stalled):
            task.cancel()
