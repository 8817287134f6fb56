"""GPU copies: two streams per registered worker; queued off the loop, completion polled on it.

Each registration has a compute stream (gathers, scatters) and a copy stream (DMA between
its staging chunks and the pool), and two staging chunks on its GPU, used in turn, so that
the kernel of one chunk overlaps the DMA of the one before. A STORE queues, on the compute
stream: a wait on the worker's interprocess event, the copies out of GPU-tier chunks being
demoted from the bytes it is about to write, then per chunk a gather of its blocks into a
staging chunk; on the copy stream, after that gather, one copy of the staging chunk into
the (pinned) pool chunk or the GPU tier. A RETRIEVE queues per chunk the copy of the pool
chunk into a staging chunk on the copy stream, and after it, on the compute stream, the
scatter into the blocks, and for an MLA leader a device-to-device copy into each
follower's staging chunk and a scatter there, on the follower's stream.

Events order the two streams, and one rule keeps a staging chunk from being overwritten
while it is still read: work that writes a staging chunk first waits for the events
recorded after every use of it since its last write, and work that reads it waits for the
event after that write (Lane.claim); so the scatter into the leader and the copies to each
follower read one staging chunk side by side, and only its next fill waits for them all.
A copy between two GPUs runs on the source GPU's current stream, fenced both ways against
the target's current one (torch's rule): each follower copies from the leader's GPU on a
stream of its own there (Lane.links), so followers never queue behind one another. The loop
polls the final events of every stream involved, so the dispatcher commits a STORE, and
answers a RETRIEVE, only once the device has finished: the loop never blocks, and
queueing (a few µs per kernel) runs on a thread of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from ...errors import ServerCondition
from ...protocol import SKIP_BLOCK
from ..memory.geometry import RAW_DTYPES, Geometry, raw
from ..memory.instance import KVCacheInstance
from .device import Device
from .engine import attempt, expired

logger = logging.getLogger(__name__)

# At least a millisecond: uvloop rounds timer delays to whole milliseconds, so a shorter
# one becomes call_soon, and the loop thread would spin on cudaEventQuery (a core, and the
# GIL the copy threads need). A copy found done costs at most _MAX_POLL_S of latency.
_FIRST_POLL_S = 1e-3
_MAX_POLL_S = 4e-3
_STALLED_POLL_S = 1.0

GatherJob = tuple[torch.Tensor, torch.Tensor]  # (block ids on the CPU, pool chunk)
ScatterJob = tuple[torch.Tensor, torch.Tensor, bool]  # (block ids, pool chunk, has skips)


class DeviceStalled(ServerCondition):
    """Queued device work did not finish in time. Until it does, the memory it touches must
    stay as it is (no chunk freed, no mapping closed): pass that clean-up to after()."""

    def __init__(self, timeout: float, settled: asyncio.Future):
        super().__init__(f"the GPU copies did not finish within {timeout:g} s")
        self.settled = settled

    def after(self, cleanup: Callable[[], None]) -> None:
        """Run `cleanup` once the device has finished the work (never, if the server exits
        first)."""
        self.settled.add_done_callback(lambda future: None if future.cancelled() else cleanup())


STAGING_CHUNKS = 2  # per registration: one is filled while the other's DMA runs


@dataclass(eq=False)
class Lane:
    """One registered worker's streams, its staging chunks, and the event its STOREs wait on."""

    device: torch.device  # the worker's GPU, where its streams and staging chunks are
    stream: Any  # gathers and scatters
    copy_stream: Any  # DMA between the staging chunks and the pool
    staging: list[torch.Tensor]  # chunk-shaped, on the worker's device, as geometry.raw
    store_event: Any | None
    # Per staging chunk, the event after its last write, and those after the reads since
    # (None, []: never used); like `turn`, changed only under the lock of the lane that
    # owns the chunk.
    written: list[Any | None] = field(default_factory=lambda: [None] * STAGING_CHUNKS)
    read: list[list[Any]] = field(default_factory=lambda: [[] for _ in range(STAGING_CHUNKS)])
    # As an MLA follower: per leader GPU, the stream there that copies into this one.
    links: dict[torch.device, Any] = field(default_factory=dict)
    turn: int = 0  # the staging chunk the next chunk goes through
    lock: threading.Lock = field(default_factory=threading.Lock)  # one request queues at a time

    def next_staging(self) -> int:
        index = self.turn
        self.turn = (index + 1) % len(self.staging)
        return index

    def waits(self, index: int, writes: bool) -> list[Any]:
        """The events work on staging chunk `index` must wait for: a write, for every use
        since the last write (each read waited for that write); a read, for that write."""
        written = self.written[index]
        if writes and self.read[index]:
            return list(self.read[index])
        return [] if written is None else [written]

    def used(self, index: int, writes: bool, event: Any) -> None:
        """`event` follows the work just queued on staging chunk `index`."""
        if writes:
            self.written[index], self.read[index] = event, []
        else:
            self.read[index].append(event)


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Small CPU index tensors onto `device` in one copy that does not wait for the stream:
    from pageable memory, CUDA would first wait for all the work queued on it."""
    if device.type != "cuda" or not tensors:
        return tensors
    sizes = [t.numel() for t in tensors]
    return list(torch.cat(tensors).pin_memory().to(device, non_blocking=True).split(sizes))


class StreamCopier:
    """Runs the GPU copies of every registration that has a Lane."""

    def __init__(self, device: Device, threads: int, timeout: float):
        """`timeout`: how long the loop waits for one request's device work."""
        self.device = device
        self.timeout = timeout
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lmcache-gpu")
        self._stalled: set[asyncio.Task] = set()

    def new_lane(self, device: torch.device, geometry: Geometry, store_event: bytes) -> Lane:
        """A registration's streams and staging chunks on `device`; `store_event` may be b""."""
        event = self.device.open_event(device, store_event) if store_event else None
        # Bytes, as integers of the cache's item size: the copies never look at the values.
        staging = [torch.empty(geometry.chunk_shape, dtype=RAW_DTYPES[geometry.itemsize],
                               device=device) for _ in range(STAGING_CHUNKS)]
        return Lane(device, self.device.new_stream(device), self.device.new_stream(device),
                    staging, event)

    async def store(self, instance: KVCacheInstance, jobs: Sequence[GatherJob],
                    moves: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
                    deadline: float | None = None) -> list[BaseException | None]:
        """Copy each job's blocks into its pool chunk, after the `moves` (destination,
        source): GPU-tier chunks being demoted out of the bytes these jobs write. Per move,
        then per job: None or what it raised (DeadlinePassed: not queued by `deadline`).
        Returns once the device has finished; raises DeviceStalled after the timeout."""
        loop = asyncio.get_running_loop()
        errors, events = await loop.run_in_executor(self._executor, self._queue_store, instance,
                                                    jobs, moves, deadline)
        await self._settle(events)
        return errors

    def _queue_store(self, instance: KVCacheInstance, jobs: Sequence[GatherJob],
                     moves: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     deadline: float | None):
        device, lane = self.device, instance.lane
        with lane.lock, device.use(lane.stream):
            if lane.store_event is not None:
                device.wait(lane.stream, lane.store_event)
            errors = [attempt(partial(dst.copy_, src, non_blocking=True)) for dst, src in moves]
            ids = _to_device([ids for ids, _ in jobs], lane.device)
            errors += [expired(deadline) or attempt(partial(self._gather, instance, ids, chunk))
                       for ids, (_, chunk) in zip(ids, jobs)]
            return errors, [device.record(lane.stream), device.record(lane.copy_stream)]

    def _gather(self, instance: KVCacheInstance, block_ids: torch.Tensor,
                chunk: torch.Tensor) -> None:
        """On the compute stream, once the next staging chunk's last DMA is done, gather into
        it; on the copy stream, once the gather is done, DMA it into `chunk`."""
        device, lane = self.device, instance.lane
        index = lane.next_staging()
        staging = lane.staging[index]
        with self._claim(lane, index, lane.stream, writes=True):
            instance.gather(block_ids, staging)
        with device.use(lane.copy_stream), self._claim(lane, index, lane.copy_stream,
                                                       writes=False):
            raw(chunk).copy_(staging, non_blocking=True)

    @contextlib.contextmanager
    def _claim(self, lane: Lane, index: int, stream: Any, writes: bool) -> Iterator[None]:
        """Work queued on `stream` within it, on staging chunk `index` of `lane`, starts
        once the chunk is free for it (Lane.waits) and is waited for by the next users: also
        when it fails halfway, since part of it may be queued."""
        for event in lane.waits(index, writes):
            self.device.wait(stream, event)
        try:
            yield
        finally:
            lane.used(index, writes, self.device.record(stream))

    async def retrieve(self, targets: Sequence[KVCacheInstance], jobs: Sequence[ScatterJob],
                       deadline: float | None = None) -> list[list[BaseException | None]]:
        """Copy each job's pool chunk into its blocks of every target (an MLA leader first,
        then its followers); per target, per job, None or what it raised (DeadlinePassed:
        not queued by `deadline`). Returns once the device has finished; raises
        DeviceStalled after the timeout."""
        loop = asyncio.get_running_loop()
        errors, events = await loop.run_in_executor(self._executor, self._queue_retrieve,
                                                    targets, jobs, deadline)
        await self._settle(events)
        return errors

    def _queue_retrieve(self, targets: Sequence[KVCacheInstance], jobs: Sequence[ScatterJob],
                        deadline: float | None):
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
                                 lane.device)
            block_ids, found = indices[:len(jobs)], iter(indices[len(jobs):])
            where_on_device = [None if p is None else next(found) for p in positions]
            for (_, chunk, _), ids, where in zip(jobs, block_ids, where_on_device):
                index = lane.next_staging()
                error = expired(deadline) or attempt(
                    partial(self._scatter, leader, index, ids, chunk, where))
                errors[0].append(error)
                for k, follower in enumerate(targets[1:], 1):
                    errors[k].append(error or attempt(
                        partial(self._fan_out, leader, index, follower, ids, where)))
            return errors, [device.record(lane.copy_stream),
                            *(device.record(target.lane.stream) for target in targets)]

    def _scatter(self, leader: KVCacheInstance, index: int, block_ids: torch.Tensor,
                 chunk: torch.Tensor, positions: torch.Tensor | None) -> None:
        """On the copy stream, once staging chunk `index` is free, DMA `chunk` into it; on
        the compute stream, once that is done, scatter it into the blocks."""
        lane = leader.lane
        staging = lane.staging[index]
        with self.device.use(lane.copy_stream), self._claim(lane, index, lane.copy_stream,
                                                            writes=True):
            staging.copy_(raw(chunk), non_blocking=True)
        with self._claim(lane, index, lane.stream, writes=False):
            leader.scatter_blocks(block_ids, staging, positions)

    def _fan_out(self, leader: KVCacheInstance, index: int, follower: KVCacheInstance,
                 block_ids: torch.Tensor, positions: torch.Tensor | None) -> None:
        """Device to device: the leader's staging chunk `index` into a follower's blocks,
        once the leader's DMA has filled it, beside the leader's scatter and the other
        followers' copies. A follower's staging chunk is only ever used here, in order on
        its stream."""
        device, mine, theirs = self.device, leader.lane, follower.lane
        mine_staging, their_staging = mine.staging[index], theirs.staging[0]
        # Between two GPUs torch copies on the source GPU's current stream, fenced both
        # ways against the target's (the scatter then follows the copy): make that a stream
        # of the follower's own, or every follower's copy would queue on the leader's.
        link = theirs.stream
        if mine.device != theirs.device:
            link = theirs.links.get(mine.device)
            if link is None:
                link = theirs.links[mine.device] = device.new_stream(mine.device)
        with device.use(theirs.stream), device.use(link), \
                self._claim(mine, index, link, writes=False):
            # Made on the leader's stream: the allocator must not reuse them before this ends.
            for tensor in (block_ids, positions):
                if tensor is not None:
                    device.used_on(tensor, link)
            their_staging.copy_(mine_staging, non_blocking=True)
            follower.scatter_blocks(block_ids, their_staging, positions)

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
