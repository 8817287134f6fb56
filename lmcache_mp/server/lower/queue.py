"""A lower tier's write queue: the chunks STOREs committed, waiting for the tier, bounded in bytes.

Each chunk is queued once under its name in the tier, unless the tier cannot write now,
already has it, or does not admit it; when the queue holds its limit in bytes, a chunk is
dropped and counted instead of waiting (a STORE never waits for a lower tier). Batches are
taken in the order chunks came, each prompt's in order. A queued chunk is held in the pool
(never evicted) from when it is offered (`hold_on_offer`: L2, whose write-behind copies
every chunk it queued) or only from when its batch is taken (the disk tier: the pool
evicts as it always does, and a chunk evicted before its turn is dropped and counted).
The tier supplies its checks: whether it can write (`available`), its name for a chunk
(`name`), whether it holds that name already (`holds`), and whether it admits it (`admit`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ..cache.chunk import Chunk
from ..cache.store import ChunkStore


class QueueCounters(Protocol):
    """The figures a write queue keeps in its tier's counters."""

    chunks_skipped: int  # committed chunks the tier has (or has queued) already
    dropped: int  # chunks not written: the tier unavailable, the queue full, evicted
    queue_bytes: int  # chunk bytes waiting
    queue_chunks: int


@dataclass
class Queued:
    chunk: Chunk
    key: bytes  # its name in the tier


Item = TypeVar("Item", bound=Queued)


class WriteQueue(Generic[Item]):
    def __init__(self, store: ChunkStore, counters: QueueCounters, limit: int, *,
                 hold_on_offer: bool, available: Callable[[], bool],
                 name: Callable[[Chunk], bytes], holds: Callable[[bytes], bool],
                 item: Callable[[Chunk, bytes], Item],
                 admit: Callable[[bytes], bool] | None = None,
                 spend: Callable[[Chunk, bytes], bool] | None = None):
        """`limit`: bytes queued at most; `item(chunk, name)`: what the tier queues; `admit`
        None: every chunk; `spend`: the tier's last word on a chunk that fits (the disk's
        write budget), None: yes."""
        self.store = store
        self.counters = counters
        self.limit = limit
        self.hold_on_offer = hold_on_offer
        self.available = available
        self.name = name
        self.holds = holds
        self.admit = admit
        self.spend = spend
        self.item = item
        self._queue: deque[Item] = deque()
        self._keys: set[bytes] = set()  # queued, or taken and not yet forgotten

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, key: bytes) -> bool:
        """Queued, or taken and not yet forgotten."""
        return key in self._keys

    def offer(self, chunks: Sequence[Chunk]) -> bool:
        """Queue chunks a STORE has just committed, each prompt's in order (loop thread;
        never waits); whether any chunk waits now."""
        counters = self.counters
        for chunk in chunks:
            if not self.available():
                counters.dropped += 1
                continue
            key = self.name(chunk)
            if key in self._keys or self.holds(key):
                counters.chunks_skipped += 1
                continue
            if self.admit is not None and not self.admit(key):
                continue
            if counters.queue_bytes + chunk.nbytes > self.limit:
                counters.dropped += 1
                continue
            if self.spend is not None and not self.spend(chunk, key):
                continue
            if self.hold_on_offer:
                held = self.store.hold_if_stored(chunk.key, chunk.geometry)
                if held is None:
                    continue  # evicted or cleared already
                chunk = held
            self._queue.append(self.item(chunk, key))
            self._keys.add(key)
            counters.queue_bytes += chunk.nbytes
            counters.queue_chunks += 1
        return bool(self._queue)

    def take(self, limit: int) -> list[Item]:
        """The next batch, of at most `limit` bytes (at least one chunk), each of its chunks
        held; those evicted while they waited unheld are dropped. They stay in the queue's
        figures and names until forgotten (forget(), settle())."""
        batch: list[Item] = []
        size = 0
        while self._queue and (not batch or size + self._queue[0].chunk.nbytes <= limit):
            queued = self._queue.popleft()
            if not self.hold_on_offer:
                held = self.store.hold_if_stored(queued.chunk.key, queued.chunk.geometry)
                if held is None:
                    self.forget([queued])
                    self.counters.dropped += 1
                    continue
                queued.chunk = held
            batch.append(queued)
            size += queued.chunk.nbytes
        return batch

    def forget(self, taken: Sequence[Item]) -> None:
        """These chunks are out of the queue's figures and names (the tier holds them now,
        or never will); their chunks stay held."""
        for queued in taken:
            self._keys.discard(queued.key)
            self.counters.queue_bytes -= queued.chunk.nbytes
            self.counters.queue_chunks -= 1

    def settle(self, taken: Sequence[Item]) -> None:
        """forget() these chunks and let go of them in the pool: their bytes are out (or
        will not be)."""
        self.forget(taken)
        self.store.unhold([queued.chunk for queued in taken])

    def clear(self) -> int:
        """Let go of every chunk still waiting; how many there were."""
        waiting = list(self._queue)
        self._queue.clear()
        if self.hold_on_offer:
            self.settle(waiting)
        else:
            self.forget(waiting)
        return len(waiting)
