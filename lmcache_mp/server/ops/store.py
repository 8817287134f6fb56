"""STORE: reserve the chunks, copy them out of the worker's blocks, then commit or abort them."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from functools import partial

from ... import phases
from ...errors import InternalError
from ...protocol import TRANSFER_SLICE_CHUNKS, StoreReply, StoreRequest, StoreStatus
from ..cache.chunk import Chunk, ChunkKey, Demotion, Reservation
from ..copy.engine import DeadlinePassed
from ..copy.streams import DeviceStalled
from ..memory.instance import KVCacheInstance
from ..net.access import Session
from .context import OpContext
from .targets import copies_for
from .transfers import (
    Place,
    Transfer,
    deadline_of,
    log_copy_failures,
    places_of,
    transfers_of,
    windows,
)


class StoreOp:
    def __init__(self, ctx: OpContext):
        self.ctx = ctx

    def __call__(self, session: Session, req: StoreRequest):
        """Validate the whole batch now; the awaitable reply copies and commits."""
        ctx = self.ctx
        deadline = deadline_of(req.budget_ms)
        instance = ctx.sender(session, req.instance_id, "STORE")
        transfers = transfers_of(session, instance, req.items,
                                 ctx.config.max_chunks_per_message)
        instance.stores += 1
        return self.run(instance, transfers, ctx.pin([instance]), deadline)

    async def run(self, instance: KVCacheInstance, transfers: list[Transfer],
                  unpin: Callable[[], None], deadline: float | None) -> StoreReply:
        """Reserve, copy, then commit or abort: each step a slice at a time. Reserved chunks
        stay invisible until their commit, so slices of other requests never see them. No
        copy out of the worker's blocks starts after `deadline`: such chunks are EXPIRED."""
        ctx, store = self.ctx, self.ctx.store
        geometry = instance.geometry
        # Chunks from a cache on the GPU tier's device go to the tier (when it has room).
        on_gpu = (ctx.gpu_pool is not None and instance.lane is not None
                  and instance.lane.staging[0].device == ctx.gpu_pool.device)
        places = places_of(transfers)
        reserved: list[list[Reservation]] = []  # per window (transfers.windows)
        pending: list[Place] = []
        demotions: list[Demotion] = []

        def reserve(window: list[tuple[int, int, int]]) -> list[Reservation]:
            return [reservation for i, start, stop in window
                    for reservation in store.reserve_run(
                        transfers[i].keys[start:stop], geometry.chunk_bytes, geometry, on_gpu,
                        transfers[i].parents[start])]

        def abort_all(demotions_landed: bool) -> None:
            for reservation in itertools.chain.from_iterable(reserved):
                if reservation.chunk is not None:
                    store.abort(reservation.chunk)
            settle = store.finish_demotion if demotions_landed else store.abort_demotion
            for demotion in demotions:
                settle(demotion)
        stamp = phases.now()
        copy_started = 0.0

        def submitted() -> None:
            nonlocal stamp, copy_started
            stamp = phases.add("STORE", "server submit", stamp, len(pending))
            copy_started = time.perf_counter()
        try:
            await ctx.each(windows(transfers), reserve, reserved, per_step=1)
            reservations = list(itertools.chain.from_iterable(reserved))
            pending = [(i, c, r.chunk) for (i, c, _), r in zip(places, reservations)
                       if r.chunk is not None]
            demotions = [r.demotion for r in reservations if r.demotion is not None]
            stamp = phases.add("STORE", "server index", stamp, len(places))
            errors: list = []
            # Chunks the server holds already (a prefill engine never looks up, so it
            # stores them again) cost the index probe and the reply: no copy, no wait on
            # the worker's device or a copy lane.
            if pending or demotions:
                errors = await copies_for(instance).store(ctx, instance, transfers, pending,
                                                          demotions, deadline, submitted)
                ctx.metrics.copied("store", time.perf_counter() - copy_started)
                log_copy_failures("STORE", errors)
                stamp = phases.add("STORE", "server copy", stamp, len(pending))
        except DeviceStalled as stall:
            # The device may still write into those chunks; when it is done, demotions landed.
            stall.after(partial(abort_all, True))
            stall.after(unpin)
            raise InternalError(f"{stall}; nothing of this STORE was stored") from None
        except BaseException:
            abort_all(False)
            unpin()
            raise
        unpin()
        return await self._commit(transfers, places, reservations, pending, demotions, errors,
                                  stamp)

    async def _commit(self, transfers: list[Transfer], places: list[tuple[int, int, ChunkKey]],
                      reservations: list[Reservation], pending: list[Place],
                      demotions: list[Demotion], errors: list, stamp: int) -> StoreReply:
        """Settle what the copies did (`errors`: the demotions', then `pending`'s): each
        demotion landed or undone, each chunk's status, the copied chunks committed a slice
        at a time (one whose parent's copy failed is not), and the committed queued for
        the lower tiers."""
        ctx, store = self.ctx, self.ctx.store
        for demotion, error in zip(demotions, errors):
            if error is None:
                store.finish_demotion(demotion)
            else:
                store.abort_demotion(demotion)
        statuses = [bytearray(len(t.keys)) for t in transfers]
        for (i, c, _), reservation in zip(places, reservations):
            statuses[i][c] = reservation.status
        copied = self._settle_failures(pending, errors[len(demotions):], statuses)
        settled = [chunk for _, _, chunk in copied]
        kept_per_window: list[list[bool]] = []
        await ctx.each([settled[start:start + TRANSFER_SLICE_CHUNKS]
                        for start in range(0, len(settled), TRANSFER_SLICE_CHUNKS)],
                       store.commit_many, kept_per_window, per_step=1)
        kept = list(itertools.chain.from_iterable(kept_per_window))
        for (i, c, _), stays in zip(copied, kept):
            if not stays:  # the copy of the chunk before it failed: no lookup could reach it
                statuses[i][c] = StoreStatus.NO_PREFIX
        committed = [chunk for (_, _, chunk), stays in zip(copied, kept) if stays]
        ctx.metrics.bytes_stored += sum(chunk.nbytes for chunk in committed)
        # Queued for the lower tiers (disk, L2), which write them after this reply has gone.
        for tier in ctx.lower:
            tier.after_store(committed)
        phases.add("STORE", "server complete", stamp, len(places))
        return StoreReply([bytes(s) for s in statuses])

    def _settle_failures(self, pending: list[Place], errors: list, statuses: list[bytearray]
                         ) -> list[Place]:
        """Abort the chunks whose copy failed, and say why in `statuses`; return the rest.
        Only an item's first failed copy says why (FAILED, EXPIRED): the chunks after it
        lost their parent (NO_PREFIX), whatever became of their own copy."""
        copied: list[tuple[int, int, Chunk]] = []
        failed_items: set[int] = set()
        for (i, c, chunk), error in zip(pending, errors):  # in item and chunk order
            if error is None:
                copied.append((i, c, chunk))
                continue
            self.ctx.store.abort(chunk)
            statuses[i][c] = (StoreStatus.NO_PREFIX if i in failed_items else
                              StoreStatus.EXPIRED if isinstance(error, DeadlinePassed)
                              else StoreStatus.FAILED)
            failed_items.add(i)
        return copied
