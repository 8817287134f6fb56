"""A lower tier's chunks into the pool, a window at a time: reserved after their parents,
committed in order.

A lower tier (the disk tier's read-back, L2's prefetch) brings a prompt's chunks into
memory a window at a time. Each chunk is a pool chunk per kv worker, reserved with its
parent (the chunk before it in the prompt, of the same kv worker: for the window's first,
the last one memory had), so that what memory keeps of the prompt stays a prefix of it;
the tier fills the reserved chunks' extents and checks them, then they are committed in
prompt order, as STORE commits. Only what says where a chunk's bytes come from differs by
tier (a disk record, an L2 key): the `source` each reserved chunk carries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from ...protocol import StoreStatus
from ..cache.chunk import Chunk, ChunkKey
from ..cache.store import ChunkStore
from ..memory.geometry import Geometry

WINDOW_BYTES = 64 * 1024**2  # chunk bytes landed in one go (at least one chunk)

Source = TypeVar("Source")
# A window: per chunk, in prompt order, each kv worker's key and where its bytes come from
# (of every kv worker, in order; with snapshot workers, of those the tier brings only).
Window = Sequence[Sequence[tuple[ChunkKey, Source]]]
# The parent of a window's chunk: (its position in the window, its key) -> its parent key
ParentOf = Callable[[int, ChunkKey], ChunkKey | None]


@dataclass(frozen=True)
class Reserved(Generic[Source]):
    chunk: Chunk  # the pool chunk reserved for it
    source: Source  # where its bytes come from
    position: int  # its chunk's place in the window


def chunks_per_window(geometries: Sequence[Geometry]) -> int:
    """How many chunks (every kv worker's) make one window of WINDOW_BYTES, at least one."""
    return max(1, WINDOW_BYTES // sum(geometry.chunk_bytes for geometry in geometries))


def first_parents(model: str, kv_world_size: int, cache_salt: str,
                  after: bytes | None) -> list[ChunkKey | None]:
    """Each kv worker's parent of a run that follows the chunk of hash `after` (None: a run
    from the prompt's start, which has no parent)."""
    return [None if after is None else ChunkKey(model, kv_world_size, worker, cache_salt, after)
            for worker in range(kv_world_size)]


def parents_in_run(parents: Sequence[ChunkKey | None], hashes: Sequence[bytes], start: int,
                   snapshot_workers: frozenset[int]) -> ParentOf | None:
    """The parents of a window of a run `hashes` that starts at hashes[start], for a LOOKUP
    with snapshot workers (None without: reserve's own): none for a snapshot worker's
    chunk (a root, as the client stores it), the same kv worker's chunk before it for the
    others' (for the window's first, `parents`)."""
    if not snapshot_workers:
        return None

    def parent_of(position: int, key: ChunkKey) -> ChunkKey | None:
        if key.kv_worker_id in snapshot_workers:
            return None
        if position == 0:
            return parents[key.kv_worker_id]
        return key._replace(chunk_hash=hashes[start + position - 1])
    return parent_of


def reserve(store: ChunkStore, window: Window[Source], parents: Sequence[ChunkKey | None],
            geometries: Sequence[Geometry], nbytes: Callable[[Source, Geometry], int],
            parent_of: ParentOf | None = None) -> tuple[list[Reserved[Source]], int]:
    """Reserve the window's chunks in memory, in prompt order, each after its parent, up to
    the first that cannot be placed for every kv worker (no room, over the salt's cap, its
    parent gone from memory). Return the reserved chunks and how many of the window's
    chunks are placed: reserved, or in memory already. `nbytes`: a chunk's size. Parents:
    `parent_of`'s, or where none is given (a window of every kv worker's chunks), the
    same kv worker's chunk before (for the window's first, `parents`)."""
    reserved: list[Reserved[Source]] = []
    for position, chunk in enumerate(window):
        placed: list[Reserved[Source]] = []
        for worker, (chunk_key, source) in enumerate(chunk):
            geometry = geometries[chunk_key.kv_worker_id]
            if parent_of is not None:
                parent = parent_of(position, chunk_key)
            else:
                parent = window[position - 1][worker][0] if position else parents[worker]
            reservation = store.reserve(chunk_key, nbytes(source, geometry), geometry,
                                        parent=parent)
            if reservation.status == StoreStatus.STORED:
                assert reservation.chunk is not None  # a STORED reservation has one
                placed.append(Reserved(reservation.chunk, source, position))
            elif reservation.status != StoreStatus.ALREADY_STORED:
                break
        else:
            reserved.extend(placed)
            continue
        abort(store, placed)
        return reserved, position
    return reserved, len(window)


def abort(store: ChunkStore, reserved: Sequence[Reserved]) -> None:
    for item in reserved:
        store.abort(item.chunk)


def commit(store: ChunkStore, reserved: Sequence[Reserved], ready: int) -> int:
    """Commit the reserved chunks before the window's `ready`th, in prompt order as STORE
    commits, and abort the rest; return how many chunks are in memory after it (a chunk
    whose parent went while it was filled, by a CLEAR, is dropped by its commit, and so is
    every chunk after it)."""
    for item in reserved:
        if item.position >= ready:
            store.abort(item.chunk)
        elif not store.commit(item.chunk):
            ready = min(ready, item.position)
    return ready
