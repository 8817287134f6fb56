"""Write-behind: chunks committed in L1 go to L2 after their STORE is answered, off its path.

The queue (lower/queue.py) is bounded in bytes: when it is full, or L2 is down, a chunk is
dropped and counted instead of waiting. A queued chunk is held in L1 (never evicted) until
its bytes are copied out; a chunk this server knows to be in L2 is not written again, and
a batch asks L2 which of its chunks are there before sending any bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Sequence

import torch

from ..cache.chunk import CPU_TIER, Chunk
from ..cache.quotas import QuotaBook
from ..cache.store import ChunkStore
from ..copy.offload import Offload
from ..lower.admission import Admission
from ..lower.names import namespace
from ..lower.queue import Queued, WriteQueue
from .base import L2, DirectL2, L2Counters, L2Error, PoolValue
from .codec import ValueFormat, l2_key
from .health import Health
from .ledger import Ledger

logger = logging.getLogger("lmcache_mp.server.l2")

BATCH_BYTES = 64 * 1024**2  # value bytes sent in one pipeline (at least one chunk)


class WriteBehind:
    def __init__(self, backend: L2, health: Health, counters: L2Counters, ledger: Ledger,
                 store: ChunkStore, quotas: QuotaBook,
                 chunk_view: Callable[[Chunk], torch.Tensor], queue_limit: int,
                 offload: Offload, values: ValueFormat, admission: Admission):
        """`chunk_view(chunk)`: the chunk's bytes in its pool (either tier); `values`: how
        they are sealed; `admission`: which chunks are queued (--l2-admission)."""
        self.backend = backend
        self.health = health
        self.counters = counters
        self.ledger = ledger
        self.quotas = quotas
        self.chunk_view = chunk_view
        self.offload = offload
        self.values = values
        self._queue = WriteQueue(store, counters, queue_limit, hold_on_offer=True,
                                 available=health.available, name=_name, holds=ledger.known,
                                 item=Queued, admit=_by_digest(admission))
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="l2-write-behind")

    def offer(self, chunks: Sequence[Chunk]) -> None:
        """Queue chunks a STORE has just committed (loop thread; never waits)."""
        if self._queue.offer(chunks):
            self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = self._queue.take(BATCH_BYTES)
                try:
                    await self._write(batch)
                except Exception:  # a bug here must not end write-behind, nor reach a STORE
                    logger.exception("L2 write-behind failed")
                if not self.health.available():  # L2 is down: drop what waits
                    self.counters.dropped += self._queue.clear()

    async def _write(self, batch: list[Queued]) -> None:
        try:
            present = await self.health.call("EXISTS", self.backend.exists(
                [queued.key for queued in batch]))
        except L2Error:
            self.counters.dropped += len(batch)
            self._queue.settle(batch)
            return
        except BaseException:
            self._queue.settle(batch)
            raise
        todo, victims = self._admit(batch, present)
        # A CPU-pool chunk goes from its extent (a direct backend: no copy), held until the
        # backend's thread is done with it; any other is copied out into a sealed value.
        direct = [queued for queued in todo if self._direct(queued.chunk)]
        copied = [queued for queued in todo if not self._direct(queued.chunk)]
        try:
            values, headers = await self.offload.run(
                lambda: (self._encode(copied), self._seal(direct)),
                lambda: self._queue.settle(batch))
        except asyncio.CancelledError:
            raise  # settled when the copy thread is done
        except BaseException:
            self._queue.settle(batch)
            raise
        if not direct:
            self._queue.settle(batch)
        try:
            if victims:
                await self.health.call("UNLINK", self.backend.delete(victims))
            if copied:
                await self.health.call("SET", self.backend.put(
                    [(queued.key, memoryview(value)) for queued, value in zip(copied, values)],
                    self.ledger.ttl_s))
        except BaseException as exc:
            if direct:
                self._queue.settle(batch)  # the direct values were never sent
            if not isinstance(exc, L2Error):
                raise
            self._failed(todo)
            return
        moved = 0
        if direct:
            if await self._put_direct(batch, direct, headers):
                moved = sum(len(header) + queued.chunk.nbytes
                            for queued, header in zip(direct, headers))
            else:
                self._failed(direct)
                direct = []
        self.counters.chunks_written += len(copied) + len(direct)
        self.counters.bytes_written += sum(len(value) for value in values) + moved
        self.counters.zero_copy_bytes += moved

    def _admit(self, batch: list[Queued], present: list[bool]
               ) -> tuple[list[Queued], list[bytes]]:
        """The batch's chunks to write (those not in L2, within the budget and their salt's
        cap, each entered in the ledger) and the values to delete to make room for them."""
        todo, victims = [], []
        # A batch's later chunks first (a queue holds prompts in order): the budget deletes
        # the oldest values first, so a prompt's end leaves L2 before its start.
        for queued, here in reversed(list(zip(batch, present))):
            if here:
                self.ledger.seen(queued.key)
                self.counters.chunks_skipped += 1
                continue
            salt = queued.chunk.key.cache_salt
            room = self.ledger.make_room(salt, queued.chunk.nbytes, self.quotas.get(salt).cap)
            if room is None:
                self.counters.dropped += 1
                continue
            victims.extend(room)
            self.ledger.add(queued.key, salt, queued.chunk.nbytes)
            todo.append(queued)
        return todo, victims

    def _failed(self, todo: list[Queued]) -> None:
        """These chunks' values were not written."""
        for queued in todo:
            self.ledger.discard(queued.key)
        self.counters.dropped += len(todo)

    def _direct(self, chunk: Chunk) -> bool:
        return isinstance(self.backend, DirectL2) and chunk.tier == CPU_TIER

    async def _put_direct(self, batch: list[Queued], direct: list[Queued],
                          headers: list[bytearray]) -> bool:
        """Put `direct`'s values from their pool extents; let go of the batch's chunks once
        the backend's thread is done with them. Whether the values were written."""
        assert isinstance(self.backend, DirectL2)  # _direct() chose them
        values = [PoolValue(queued.key, header, self.chunk_view(queued.chunk).data_ptr(),
                            queued.chunk.nbytes) for queued, header in zip(direct, headers)]
        try:
            await self.health.call_on_pool("SET", self.backend.put_from(values),
                                           lambda: self._queue.settle(batch))
        except L2Error:
            return False
        self._queue.settle(batch)
        return True

    def _encode(self, todo: list[Queued]) -> list[bytearray]:
        """Copy each chunk out of its pool into a sealed value (a copy thread)."""
        values = []
        for queued in todo:
            value = self.values.buffer(queued.chunk.nbytes)
            torch.frombuffer(value, dtype=torch.uint8, offset=self.values.header_bytes).copy_(
                self.chunk_view(queued.chunk))
            self.values.seal(queued.key, value)
            values.append(value)
        return values

    def _seal(self, todo: list[Queued]) -> list[bytearray]:
        """Each CPU-pool chunk's header, sealed over its bytes where they lie (a copy
        thread)."""
        headers = []
        for queued in todo:
            header = bytearray(self.values.header_bytes)
            self.values.seal_header(queued.key, header,
                                    self.chunk_view(queued.chunk).numpy().data)
            headers.append(header)
        return headers

    async def close(self) -> None:
        """Stop writing; the queue's chunks are let go (a batch being copied out, once its
        copy is done: the tier closes the Offload after this)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._queue.clear()


def _by_digest(admission: Admission) -> Callable[[bytes], bool]:
    """The policy asked with a digest of the L2 key: a fingerprint table (Reused) takes
    its slot and fingerprint from a key's bytes, which only a digest spreads evenly."""
    def admit(key: bytes) -> bool:
        return admission.admit(hashlib.blake2b(key, digest_size=16).digest())
    return admit


def _name(chunk: Chunk) -> bytes:
    return l2_key(namespace(chunk.key.model, chunk.geometry), chunk.key)
