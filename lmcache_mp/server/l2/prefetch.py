"""Prefetch on a LOOKUP miss: pull the chunks that continue an L1 hit from L2 into L1.

A LOOKUP item whose run of chunks stops short in L1 starts a pull of the rest: one
pipelined EXISTS finds how far L2's run goes, then GETs in windows bring the values,
which are verified (a bad value ends the run, as a miss) and copied into reserved L1
chunks, committed in prompt order (lower/landing.py: each pulled chunk is reserved with
its parent, so that what L1 keeps of the prompt stays a prefix of it). The LOOKUP waits for
its pulls at most --l2-prefetch-wait, then answers from L1 with whatever has landed; the
pull goes on for the next LOOKUP. Two LOOKUPs of the same run share one pull. RETRIEVE
never waits on L2.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Awaitable, Sequence

import torch

from ..cache.chunk import ChunkKey
from ..cache.pool import CpuPool
from ..cache.store import ChunkStore
from ..copy.offload import Offload
from ..lower import landing
from ..lower.hook import LookupHook
from ..lower.landing import Reserved, Window, chunks_per_window, first_parents
from ..lower.names import namespace
from ..memory.geometry import Geometry
from ..memory.registry import Registry
from .base import L2, DirectL2, L2Counters, L2Error, PoolValue
from .codec import ValueFormat, l2_key
from .health import Health
from .ledger import Ledger

logger = logging.getLogger("lmcache_mp.server.l2")

MAX_PULLS = 64  # pulls in flight at once; LOOKUPs beyond it answer from L1 alone


def _copy_payload(value: bytes, header_bytes: int, target: torch.Tensor) -> None:
    """Copy a verified value's payload into a chunk's pool bytes; ctypes' memmove lets go of
    the GIL, and no tensor is made over the read-only `bytes`."""
    address = ctypes.cast(ctypes.c_char_p(value), ctypes.c_void_p).value
    assert address is not None  # a bytes object's buffer is never NULL
    ctypes.memmove(target.data_ptr(), address + header_bytes, target.numel())


class Prefetcher:
    def __init__(self, backend: L2, health: Health, counters: L2Counters, ledger: Ledger,
                 store: ChunkStore, registry: Registry, pool: CpuPool, wait_s: float,
                 offload: Offload, values: ValueFormat):
        self.backend = backend
        self.health = health
        self.counters = counters
        self.ledger = ledger
        self.store = store
        self.pool = pool
        self.offload = offload
        self.values = values
        self._hook = LookupHook(store, registry, MAX_PULLS, wait_s, self._timed_out,
                                health.available, self._pull)

    def before_lookup(self, model: str, kv_world_size: int,
                      items: Sequence[tuple[str, Sequence[bytes]]],
                      snapshot_workers: frozenset[int]) -> Awaitable[None] | None:
        """Start (or join) pulls for the items whose run continues past L1 (none while L2
        is known down); return what the LOOKUP should await before it looks in L1, or None
        to look at once."""
        return self._hook.before_lookup(model, kv_world_size, items, snapshot_workers)

    def _timed_out(self) -> None:
        self.counters.prefetch_timeouts += 1

    async def _pull(self, model: str, kv_world_size: int, cache_salt: str,
                    after: bytes | None, hashes: Sequence[bytes],
                    geometries: list[Geometry], snapshot_workers: frozenset[int]) -> None:
        """Bring L2's run of `hashes` into L1, the prompt's chunks after the one of hash
        `after` (None: from its start), and with snapshot workers theirs where L2 has them,
        each a root (_run); never raises (an L2 failure is counted)."""
        parents = first_parents(model, kv_world_size, cache_salt, after)
        spaces = [namespace(model, geometry) for geometry in geometries]
        keys = [[(ChunkKey(model, kv_world_size, worker, cache_salt, chunk_hash),
                  l2_key(spaces[worker], ChunkKey(model, kv_world_size, worker, cache_salt,
                                                  chunk_hash)))
                 for worker in range(kv_world_size)] for chunk_hash in hashes]
        counters = self.counters
        try:
            present = await self.health.call("EXISTS", self.backend.exists(
                [key for chunk in keys for _, key in chunk]))
            run = self._run(keys, present, snapshot_workers)
            counters.misses += len(keys) - len(run)
            per_window = chunks_per_window(geometries)
            for start in range(0, len(run), per_window):
                window = run[start:start + per_window]
                parent_of = landing.parents_in_run(parents, hashes, start, snapshot_workers)
                landed, corrupt = await self._land(window, parents, geometries, parent_of)
                # Counted together, with no await between them and the misses below: a
                # corrupt value is also a miss, at every moment the counters are read.
                counters.hits += sum(1 for chunk in window[:landed] if chunk)  # pulled
                counters.corrupt += corrupt
                parents = first_parents(model, kv_world_size, cache_salt,
                                        hashes[start + len(window) - 1])
                if landed < len(window):
                    counters.misses += len(run) - start - landed
                    return
        except L2Error:
            return
        except Exception:  # nothing of a pull may reach a LOOKUP
            logger.exception("L2 prefetch failed")

    def _run(self, keys: list[list[tuple[ChunkKey, bytes]]], present: list[bool],
             snapshot_workers: frozenset[int]) -> list[list[tuple[ChunkKey, bytes]]]:
        """The chunks to pull, each as its kv workers' (L1 key, L2 key) pairs. Without
        snapshot workers: the leading chunks L2 holds for every kv worker. With them, of
        each chunk the pieces L1 lacks and L2 holds, up to the first chunk of which another
        kv worker's piece is in neither (a snapshot worker's: where L2 has it)."""
        run: list[list[tuple[ChunkKey, bytes]]] = []
        for position, chunk in enumerate(keys):
            held = present[position * len(chunk):(position + 1) * len(chunk)]
            if not snapshot_workers:
                if not all(held):
                    break
                run.append(chunk)
                continue
            pieces = []
            for (chunk_key, key), in_l2 in zip(chunk, held):
                if self.store.is_stored(chunk_key):
                    continue
                if in_l2:
                    pieces.append((chunk_key, key))
                elif chunk_key.kv_worker_id not in snapshot_workers:
                    return run
            run.append(pieces)
        return run

    async def _land(self, window: list[list[tuple[ChunkKey, bytes]]],
                    parents: list[ChunkKey | None], geometries: list[Geometry],
                    parent_of: landing.ParentOf | None) -> tuple[int, int]:
        """Fetch, verify and commit one window of chunks, in order, the first after
        `parents` (per kv worker); return how many chunks are in L1 after it (a bad value,
        a full pool or a parent gone from L1 ends the run there), and how many values
        failed their check."""
        if isinstance(self.backend, DirectL2):
            return await self._land_direct(self.backend, window, parents, geometries,
                                           parent_of)
        flat = [pair for chunk in window for pair in chunk]
        values = await self.health.call("GET", self.backend.get([key for _, key in flat]))
        self.counters.bytes_read += sum(len(value) for value in values if value is not None)
        sizes = [geometries[chunk_key.kv_worker_id].chunk_bytes for chunk_key, _ in flat]
        intact = await self.offload.run(lambda: [
            value is not None and self.values.payload(key, value, size) is not None
            for (_, key), value, size in zip(flat, values, sizes)], lambda: None)
        bad, corrupt = _first_bad(intact, [p for p, chunk in enumerate(window) for _ in chunk],
                                  len(window))
        reserved, chunks_ready = self._reserve(window[:bad], parents, geometries, parent_of)
        value_of = {key: value for (_, key), value in zip(flat, values)}
        header_bytes = self.values.header_bytes

        def abort() -> None:
            landing.abort(self.store, reserved)

        def copy_reserved() -> None:
            for item in reserved:
                chunk = item.chunk
                value = value_of[item.source]
                assert value is not None  # intact
                _copy_payload(value, header_bytes, self.pool.view(chunk.offset, chunk.nbytes))
        try:
            await self.offload.run(copy_reserved, abort)
        except asyncio.CancelledError:
            raise  # aborted when the copy thread is done
        except BaseException:
            abort()
            raise
        # A value past where L1 had no room is not counted: the run ended before it.
        return landing.commit(self.store, reserved, chunks_ready), \
            corrupt if chunks_ready == bad else 0

    async def _land_direct(self, backend: DirectL2, window: list[list[tuple[ChunkKey, bytes]]],
                           parents: list[ChunkKey | None], geometries: list[Geometry],
                           parent_of: landing.ParentOf | None) -> tuple[int, int]:
        """_land() without a copy: the window's L1 chunks are reserved first, the backend
        reads each value's payload straight into its chunk's pool extent, and the chunks
        are verified there before any is committed (visible)."""
        reserved, chunks_ready = self._reserve(window, parents, geometries, parent_of)
        if not reserved:
            return chunks_ready, 0
        values = [PoolValue(item.source, bytearray(self.values.header_bytes),
                            self.pool.view(item.chunk.offset, item.chunk.nbytes).data_ptr(),
                            item.chunk.nbytes)
                  for item in reserved]

        def abort() -> None:
            landing.abort(self.store, reserved)
        read = await self.health.call_on_pool("GET", backend.get_into(values), abort)
        moved = sum(len(value.header) + value.size for value, whole in zip(values, read)
                    if whole)
        self.counters.bytes_read += moved
        self.counters.zero_copy_bytes += moved

        def verify() -> list[bool]:
            return [whole and self.values.vouches(
                value.key, value.header,
                self.pool.array_view(item.chunk.offset, item.chunk.nbytes).data)
                for item, value, whole in zip(reserved, values, read)]
        try:
            intact = await self.offload.run(verify, abort)
        except asyncio.CancelledError:
            raise  # aborted when the check's thread is done
        except BaseException:
            abort()
            raise
        corrupt = 0
        failed = [item.position for item, good in zip(reserved, intact) if not good]
        if failed:  # the first chunk with a value that failed its check ends the run
            corrupt = failed.count(failed[0])
            chunks_ready = min(chunks_ready, failed[0])
        return landing.commit(self.store, reserved, chunks_ready), corrupt

    def _reserve(self, window: Window[bytes], parents: list[ChunkKey | None],
                 geometries: list[Geometry], parent_of: landing.ParentOf | None
                 ) -> tuple[list[Reserved[bytes]], int]:
        """landing.reserve() of the window's chunks, each with its L2 key; the values of
        those placed are known to be in L2 from now on."""
        reserved, placed = landing.reserve(self.store, window, parents, geometries,
                                           _chunk_bytes, parent_of)
        for chunk in window[:placed]:
            for _, key in chunk:
                self.ledger.seen(key)
        return reserved, placed

    async def close(self) -> None:
        await self._hook.close()


def _chunk_bytes(_key: bytes, geometry: Geometry) -> int:
    return geometry.chunk_bytes


def _first_bad(intact: list[bool], positions: list[int], chunks: int) -> tuple[int, int]:
    """The index of the first chunk with a value that is not intact (`chunks` if none),
    and how many of that chunk's values are not; `positions`: each value's chunk."""
    for good, position in zip(intact, positions):
        if not good:
            return position, sum(1 for ok, at in zip(intact, positions)
                                 if at == position and not ok)
    return chunks, 0
