"""Transfer planning shared by STORE and RETRIEVE: items, block ids, windows, runs, deadlines."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import TypeVar

import numpy as np

from ...errors import BadRequest
from ...protocol import (
    BLOCK_ID_BYTES,
    CHUNK_HASH_BYTES,
    SKIP_BLOCK,
    TRANSFER_SLICE_CHUNKS,
    LookupItem,
    TransferItem,
    check_hashes,
    unpack_hashes,
    validate_salt,
)
from ..cache.chunk import Chunk, ChunkKey, LeaseOwner
from ..copy.engine import DeadlinePassed
from ..memory.host_rows import HostRows
from ..memory.instance import KVCacheInstance
from ..net.access import Session

T = TypeVar("T")

logger = logging.getLogger(__name__)

# Chunks whose bytes follow one another in the pool copy as one run: one np.take (or one
# assignment) for all their rows, so that a copy thread takes the GIL once a run, not once
# a chunk (a W2 STORE's 512 KiB chunks spent ~10% of their copy time on 2 CPUs waiting for
# it). A run is at most COPY_RUN_BYTES: a copy started before a deadline ends soon after.
COPY_RUN_BYTES = 4 * 1024**2

# A place in a message: (item, chunk index in the item, the chunk)
Place = tuple[int, int, Chunk]

_chunk_hashes = attrgetter("chunk_hashes")


def lease_owner(session: Session, cache_salt: str, request_id: str, prefix: str = ""
                ) -> LeaseOwner:
    """Whose hold an item's chunks are: the session's engine, under the item's salt (its
    characters checked here; the decoder checked its length and the request id's)."""
    return LeaseOwner(session.engine, validate_salt(cache_salt, f"{prefix}cache_salt"),
                      request_id)


def chunks_named(items: Sequence[LookupItem | TransferItem], limit: int) -> int:
    """The chunks a message's items name, from their packed hashes' lengths: checked against
    `limit` (--max-chunks-per-message) before any per-chunk work."""
    total = sum(map(len, map(_chunk_hashes, items))) // CHUNK_HASH_BYTES
    if total > limit:
        raise BadRequest(f"`items`: {total} chunks in one message; the limit is {limit}")
    return total


def deadline_of(budget_ms: int) -> float | None:
    """A STORE's or RETRIEVE's deadline (time.monotonic()), counted from now, its receipt:
    no copy touches its blocks after it. None for budget_ms 0, no deadline (its range the
    decoder checked)."""
    return time.monotonic() + budget_ms / 1000 if budget_ms else None


class Transfer:
    """One validated STORE or RETRIEVE item: its keys and, per chunk, its block ids."""

    def __init__(self, session: Session, instance: KVCacheInstance, item: TransferItem,
                 path: str, block_ids: np.ndarray, skips: list[bool]):
        """`block_ids`: the item's ids, checked, as [chunks, blocks per chunk]; `skips`:
        per chunk, whether some id is SKIP_BLOCK (both from BlockIds, off the copy path)."""
        self.owner = lease_owner(session, item.cache_salt, item.request_id, f"{path}.")
        self.load_seq = item.load_seq
        salt = self.owner.cache_salt
        hashes = unpack_hashes(item.chunk_hashes, f"{path}.chunk_hashes")
        self.keys = [ChunkKey(instance.model, instance.kv_world_size, instance.kv_worker_id,
                              salt, h) for h in hashes]
        parent = unpack_hashes(item.parent_hash, f"{path}.parent_hash")
        if len(parent) > 1:
            raise BadRequest(f"`{path}.parent_hash`: one hash or none, got {len(parent)}")
        # STORE: each chunk's parent, the prompt's chunk before it
        self.parents = [self.keys[0]._replace(chunk_hash=parent[0]) if parent and hashes
                        else None, *self.keys[:-1]]
        self.block_ids = block_ids
        self.skips = skips


class BlockIds:
    """The block ids of all of a message's items, checked at once: one array and a few
    numpy operations per message, not per item, so that many small items stay cheap (and
    no torch dispatch, whose code runs cold after each request's copies)."""

    def __init__(self, instance: KVCacheInstance, items: list[TransferItem], allow_skip: bool):
        per_chunk = instance.geometry.blocks_per_chunk
        self.chunks: list[int] = []
        for i, item in enumerate(items):
            chunks, rest = divmod(len(item.chunk_hashes), CHUNK_HASH_BYTES)
            if rest or len(item.block_ids) != chunks * per_chunk * BLOCK_ID_BYTES:
                self._refuse_lengths(i, item, per_chunk)
            self.chunks.append(chunks)
        packed = b"".join(item.block_ids for item in items)
        ids = np.frombuffer(packed, dtype="<i4").astype(np.int64)
        skipped = ids == SKIP_BLOCK if allow_skip else None
        written = ids[~skipped] if skipped is not None else ids
        if len(written) and (written.min() < 0 or written.max() >= instance.num_blocks):
            self._refuse_range(instance, ids, skipped, allow_skip)
        rows = ids.reshape(-1, per_chunk)
        ends = list(itertools.accumulate(self.chunks))
        # Slices, not np.split (whose Python costs ~3 µs an item).
        self.per_item: list[np.ndarray] = [rows[end - n:end] for end, n in zip(ends, self.chunks)]
        flags = (skipped.reshape(-1, per_chunk).any(1).tolist() if skipped is not None
                 else [False] * len(rows))
        self.skips = [flags[end - n:end] for end, n in zip(ends, self.chunks)]

    @staticmethod
    def _refuse_lengths(i: int, item: TransferItem, per_chunk: int) -> None:
        path = f"items[{i}]"
        check_hashes(item.chunk_hashes, f"{path}.chunk_hashes")
        if len(item.block_ids) % BLOCK_ID_BYTES:
            raise BadRequest(f"`{path}.block_ids`: length {len(item.block_ids)} is not a "
                             f"multiple of {BLOCK_ID_BYTES}")
        chunks = len(item.chunk_hashes) // CHUNK_HASH_BYTES
        raise BadRequest(f"`{path}.block_ids`: {chunks} chunks need {chunks * per_chunk} "
                         f"block ids ({per_chunk} per chunk), got "
                         f"{len(item.block_ids) // BLOCK_ID_BYTES}")

    def _refuse_range(self, instance: KVCacheInstance, ids: np.ndarray,
                      skipped: np.ndarray | None, allow_skip: bool) -> None:
        """Name the first item with an id out of range, and its range."""
        per_chunk = instance.geometry.blocks_per_chunk
        start = 0
        for i, chunks in enumerate(self.chunks):
            end = start + chunks * per_chunk
            written = ids[start:end] if skipped is None else ids[start:end][~skipped[start:end]]
            start = end
            if len(written) and not (0 <= written.min() and written.max() < instance.num_blocks):
                skip = f" (or {SKIP_BLOCK} to leave a block alone)" if allow_skip else ""
                raise BadRequest(f"`items[{i}].block_ids`: ids must be in "
                                 f"[0, {instance.num_blocks}){skip}, got range "
                                 f"[{int(written.min())}, {int(written.max())}]")


def transfers_of(session: Session, instance: KVCacheInstance, items: list[TransferItem],
                 max_chunks: int, allow_skip: bool = False) -> list[Transfer]:
    """A STORE's or RETRIEVE's items, validated as a whole before anything is applied."""
    chunks_named(items, max_chunks)
    block_ids = BlockIds(instance, items, allow_skip)
    return [Transfer(session, instance, item, f"items[{i}]", ids, skips)
            for i, (item, ids, skips) in enumerate(zip(items, block_ids.per_item,
                                                       block_ids.skips))]


def places_of(transfers: Sequence[Transfer]) -> list[tuple[int, int, ChunkKey]]:
    """(item, chunk index, key) of every chunk of a message, in order."""
    return [(i, c, key) for i, t in enumerate(transfers) for c, key in enumerate(t.keys)]


def windows(transfers: Sequence[Transfer]) -> list[list[tuple[int, int, int]]]:
    """The items' chunks, in order, as windows of at most TRANSFER_SLICE_CHUNKS: each a list
    of (item, start, stop) stretches of one item."""
    result: list[list[tuple[int, int, int]]] = [[]]
    room = TRANSFER_SLICE_CHUNKS
    for i, transfer in enumerate(transfers):
        start = 0
        while start < len(transfer.keys):
            if not room:
                result.append([])
                room = TRANSFER_SLICE_CHUNKS
            stop = min(len(transfer.keys), start + room)
            result[-1].append((i, start, stop))
            room -= stop - start
            start = stop
    return result


def copy_runs(places: Sequence[Place], mergeable: Callable[[Place], bool]
              ) -> list[tuple[int, int]]:
    """(start, count) runs covering `places` ((item, chunk index, chunk), in order). A place
    joins the run before it when both are `mergeable` and it is the same item's next chunk,
    in the same tier, starting where the one before ends, within COPY_RUN_BYTES."""
    runs: list[tuple[int, int]] = []
    for index, place in enumerate(places):
        if runs:
            start, count = runs[-1]
            last = places[index - 1]
            i, c, chunk = place
            if (last[0] == i and last[1] + 1 == c and last[2].tier == chunk.tier
                    and last[2].offset + last[2].nbytes == chunk.offset
                    and (count + 1) * chunk.nbytes <= COPY_RUN_BYTES
                    and mergeable(place) and mergeable(last)):
                runs[-1] = (start, count + 1)
                continue
        runs.append((index, 1))
    return runs


def per_chunk(runs: list[tuple[int, int]], outcomes: Sequence[T]) -> list[T]:
    """Each run's outcome once for each of its chunks."""
    return [outcome for (_, count), outcome in zip(runs, outcomes) for _ in range(count)]


def message_rows(host: HostRows, transfers: Sequence[Transfer]) -> tuple[np.ndarray, list[int]]:
    """host.rows() of every chunk of a message's items, from one call (numpy's cost per call
    paid once a message, not once an item), and where each item's chunks start: item i's
    chunk c is row first[i] + c. Rows of skipped blocks are made too, and never used."""
    ids = [transfer.block_ids for transfer in transfers]
    rows = host.rows(np.concatenate(ids)) if ids else np.empty((0, 0), dtype=np.int64)
    return rows, [0, *itertools.accumulate(len(block_ids) for block_ids in ids)]


def log_copy_failures(op: str, outcomes: Sequence[BaseException | None]) -> None:
    """A copy that raised (not one its deadline kept from starting) is the server's or the
    device's fault, never the client's: say so, once a request, with the first error. The
    client hears of it only as chunks not stored or not loaded."""
    if not any(outcomes):
        return
    failed = [error for error in outcomes
              if error is not None and not isinstance(error, DeadlinePassed)]
    if failed:
        logger.error("%s: %d of %d chunk copies failed", op, len(failed), len(outcomes),
                     exc_info=failed[0])


def leading_successes(errors, count: int) -> int:
    """How many of the next `count` copy outcomes succeed before the first failure."""
    outcomes = [next(errors) is None for _ in range(count)]
    return outcomes.index(False) if False in outcomes else count
