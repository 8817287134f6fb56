"""RETRIEVE: hold each item's leading chunks, copy them into the worker's blocks, release."""

from __future__ import annotations

import time
from collections.abc import Callable

from ... import phases
from ...errors import InternalError
from ...protocol import LoadDone, LoadDoneItem, RetrieveReply, RetrieveRequest
from ..cache.chunk import Chunk, ChunkKey
from ..copy.streams import DeviceStalled
from ..memory.instance import KVCacheInstance
from ..net.access import Session
from .context import OpContext
from .targets import copies_for
from .transfers import (
    Transfer,
    deadline_of,
    leading_successes,
    log_copy_failures,
    places_of,
    transfers_of,
)


class RetrieveOp:
    def __init__(self, ctx: OpContext):
        self.ctx = ctx

    def __call__(self, session: Session, req: RetrieveRequest):
        """Validate the whole batch now; the awaitable reply holds, copies and releases."""
        ctx = self.ctx
        deadline = deadline_of(req.budget_ms)
        leader = ctx.sender(session, req.instance_id, "RETRIEVE")
        transfers = transfers_of(session, leader, req.items, ctx.config.max_chunks_per_message,
                                 allow_skip=True)
        leader.retrieves += 1
        # Under MLA every rank of the TP group holds the same latent cache: fill them all.
        targets = [leader, *ctx.registry.tp_followers(leader)]
        return self.run(leader, targets, transfers, ctx.pin(targets), deadline,
                        req.progress_tag)

    async def run(self, leader: KVCacheInstance, targets: list[KVCacheInstance],
                  transfers: list[Transfer], unpin: Callable[[], None],
                  deadline: float | None, progress_tag: int = 0) -> RetrieveReply:
        """Hold each item's leading stored chunks, copy them, unhold: a slice at a time. No
        copy into any target's blocks starts after `deadline`: `retrieved` stops there.
        With a `progress_tag`, a cache in CPU memory (no MLA followers) is written layer by
        layer, and LoadProgress goes to the sender as layers settle."""
        ctx, store = self.ctx, self.ctx.store
        held: list[list[Chunk]] = [[] for _ in transfers]
        geometry = leader.geometry

        def unhold() -> None:
            for chunks in held:
                store.unhold(chunks)

        def hold(place: tuple[int, int, ChunkKey]) -> None:
            i, c, key = place
            if len(held[i]) == c:  # every earlier chunk of the item was there: a prefix
                chunk = store.hold_if_stored(key, geometry)
                if chunk is not None:
                    held[i].append(chunk)
        stamp = phases.now()
        copy_started = 0.0
        flat: list = []

        def submitted() -> None:
            nonlocal stamp, copy_started
            stamp = phases.add("RETRIEVE", "server submit", stamp, len(flat))
            copy_started = time.perf_counter()
        try:
            places = places_of(transfers)
            await ctx.each(places, hold, [])
            stamp = phases.add("RETRIEVE", "server index", stamp, len(places))
            flat = [(i, c, chunk) for i, chunks in enumerate(held)
                    for c, chunk in enumerate(chunks)]
            outcomes = await copies_for(leader).retrieve(ctx, targets, transfers, flat,
                                                         deadline, progress_tag, submitted)
            ctx.metrics.copied("retrieve", time.perf_counter() - copy_started)
            log_copy_failures("RETRIEVE", outcomes)
            stamp = phases.add("RETRIEVE", "server copy", stamp, len(flat) * len(targets))
        except DeviceStalled as stall:
            stall.after(unhold)  # the device may still read those chunks
            stall.after(unpin)
            raise InternalError(f"{stall}; treat the blocks of this RETRIEVE as unwritten"
                                ) from None
        except BaseException:
            unhold()
            unpin()
            raise
        unpin()
        unhold()
        reply = self._settle(leader, targets, transfers, held, outcomes)
        phases.add("RETRIEVE", "server complete", stamp, len(flat))
        return reply

    def _settle(self, leader: KVCacheInstance, targets: list[KVCacheInstance],
                transfers: list[Transfer], held: list[list[Chunk]], outcomes: list
                ) -> RetrieveReply:
        """What landed, per target and item (the leading chunks whose copies succeeded):
        counted, the items' leases released, the followers told (LoadDone), the leader's
        the reply."""
        ctx, store, geometry = self.ctx, self.ctx.store, leader.geometry
        errors = iter(outcomes)
        landed = {target.instance_id: [leading_successes(errors, len(chunks)) for chunks in held]
                  for target in targets}
        ctx.metrics.bytes_retrieved += geometry.chunk_bytes * sum(
            sum(counts) for counts in landed.values())
        for t in transfers:
            store.release(t.owner, leader.kv_worker_id)
        for follower in targets[1:]:
            follower.loads_pushed += 1
            ctx.push(follower.owner, LoadDone(follower.instance_id, [
                LoadDoneItem(t.owner.request_id, t.owner.cache_salt, n, t.load_seq)
                for t, n in zip(transfers, landed[follower.instance_id])]))
        return RetrieveReply(landed[leader.instance_id])
