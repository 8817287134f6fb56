"""LOOKUP: each item's longest stored prefix, held if asked, after the lower tiers' bounded
read-backs (the disk tier's, then L2's)."""

from __future__ import annotations

from collections.abc import Awaitable

from ... import phases
from ...errors import BadRequest
from ...protocol import (
    CHUNK_HASH_BYTES,
    LOOKUP_SLICE_PROBES,
    MAX_LOOKUP_PROBES,
    LookupReply,
    LookupRequest,
    check_hashes,
    split_hashes,
    validate_salt,
)
from ..cache.chunk import LeaseOwner
from ..cache.scan import PrefixScan
from ..net.access import Session
from .context import OpContext
from .transfers import chunks_named

MAX_VALID_SALTS_KEPT = 1024  # LookupOp._valid_salts

# (salt, hashes, holder or None) per item: what the store's lookups take
Parsed = list[tuple[str, tuple[bytes, ...], LeaseOwner | None]]


class LookupOp:
    def __init__(self, ctx: OpContext):
        self.ctx = ctx
        # Salts found valid: a LOOKUP's items mostly name the salts of the last ones, and
        # skip the check (a regular expression) for them. Emptied when it fills.
        self._valid_salts: set[str] = set()

    def __call__(self, session: Session, req: LookupRequest
                 ) -> LookupReply | Awaitable[LookupReply]:
        # The decoder checked every field's range and length (protocol/messages.py).
        probes = chunks_named(req.items, self.ctx.config.max_chunks_per_message) \
            * req.kv_world_size
        if probes > MAX_LOOKUP_PROBES:
            raise BadRequest(f"`items`: {probes} index probes (chunk hashes times kv_world_size "
                             f"{req.kv_world_size}) in one LOOKUP; the limit is "
                             f"{MAX_LOOKUP_PROBES}")
        parsed: Parsed = []
        valid_salts = self._valid_salts
        for i, item in enumerate(req.items):
            salt, packed = item.cache_salt, item.chunk_hashes
            if salt not in valid_salts or len(packed) % CHUNK_HASH_BYTES:
                validate_salt(salt, f"items[{i}].cache_salt")  # its path: only what may be wrong
                check_hashes(packed, f"items[{i}].chunk_hashes")
                if len(valid_salts) >= MAX_VALID_SALTS_KEPT:
                    valid_salts.clear()
                valid_salts.add(salt)
            # Only a hold needs a lease owner: plain lookups, the common case, build none.
            holder = LeaseOwner(session.engine, salt, item.request_id) if item.hold else None
            parsed.append((salt, split_hashes(packed), holder))
        if self.ctx.disk is not None or self.ctx.l2 is not None:
            items = [(salt, hashes) for salt, hashes, _ in parsed]
            disk, l2 = self.ctx.disk, self.ctx.l2
            if disk is not None:
                read_back = disk.before_lookup(req.model, req.kv_world_size, items)
                if read_back is not None:
                    in_memory = self._resident(req, items, probes) if req.tiers else None
                    return self._after_disk(read_back, req, parsed, items, probes, in_memory)
            if l2 is not None:
                prefetch = l2.before_lookup(req.model, req.kv_world_size, items)
                if prefetch is not None:
                    in_memory = self._resident(req, items, probes) if req.tiers else None
                    return self._after(prefetch, req, parsed, probes, in_memory)
        reply = self._now(req, parsed, probes)
        if not req.tiers:
            return reply
        return (_in_memory(reply) if isinstance(reply, LookupReply)
                else self._sliced_in_memory(reply))

    def _now(self, req: LookupRequest, parsed: Parsed, probes: int
             ) -> LookupReply | Awaitable[LookupReply]:
        if probes <= LOOKUP_SLICE_PROBES:
            stamp = phases.now() if phases.enabled else 0
            reply = LookupReply(self.ctx.store.lookup_many(req.model, req.kv_world_size, parsed))
            if phases.enabled:
                phases.add("LOOKUP", "server index", stamp, probes)
            return reply
        return self._sliced(req, parsed)

    def _resident(self, req: LookupRequest, items: list[tuple[str, tuple[bytes, ...]]],
                  probes: int) -> list[int] | None:
        """Per item, its leading chunks in memory before a lower tier reads back (one more
        probe per chunk hash and kv worker); None for a LOOKUP too large to probe at once:
        its hits' tiers are not counted."""
        if probes > LOOKUP_SLICE_PROBES:
            return None
        resident_run = self.ctx.store.resident_run
        return [resident_run(req.model, req.kv_world_size, salt, hashes)
                for salt, hashes in items]

    @staticmethod
    async def _sliced_in_memory(reply: Awaitable[LookupReply]) -> LookupReply:
        """A sliced LOOKUP for which no lower tier read back: every hit was in memory."""
        return _in_memory(await reply)

    async def _after_disk(self, read_back: Awaitable[None], req: LookupRequest, parsed: Parsed,
                          items: list[tuple[str, tuple[bytes, ...]]], probes: int,
                          in_memory: list[int] | None) -> LookupReply:
        """What the disk had is in memory (or the bounded wait is over): L2 for the rest."""
        await read_back
        l2 = self.ctx.l2
        prefetch = l2.before_lookup(req.model, req.kv_world_size, items) if l2 else None
        after_disk = None
        if prefetch is not None:
            after_disk = self._resident(req, items, probes) if in_memory is not None else None
            await prefetch
        reply = self._now(req, parsed, probes)
        done = reply if isinstance(reply, LookupReply) else await reply
        if in_memory is not None:
            done.hit_tiers = _split(done.hits, in_memory, after_disk)
        return done

    async def _after(self, prefetch: Awaitable[None], req: LookupRequest, parsed: Parsed,
                     probes: int, in_memory: list[int] | None) -> LookupReply:
        """Look in L1 once L2's chunks have landed there, or the bounded wait is over."""
        await prefetch
        reply = self._now(req, parsed, probes)
        done = reply if isinstance(reply, LookupReply) else await reply
        if in_memory is not None:
            done.hit_tiers = _split(done.hits, in_memory, in_memory)
        return done

    async def _sliced(self, req: LookupRequest, parsed: Parsed) -> LookupReply:
        """A LOOKUP of many probes, LOOKUP_SLICE_PROBES at a time between other clients'
        requests; each item's chunks stay held between its slices."""
        scans = [(PrefixScan(self.ctx.store, req.model, req.kv_world_size, salt, hashes,
                             hold_while_scanning=True), holder)
                 for salt, hashes, holder in parsed]
        hits: list[int] = []

        def step() -> bool:
            budget = LOOKUP_SLICE_PROBES
            while budget > 0 and len(hits) < len(scans):
                scan, holder = scans[len(hits)]
                budget -= scan.step(budget)
                if scan.done:
                    hits.append(scan.finish(holder))
            return len(hits) == len(scans)
        try:
            await self.ctx.slices.run(step)
        except BaseException:
            for scan, _ in scans[len(hits):]:
                scan.abandon()
            raise
        return LookupReply(hits)


def _in_memory(reply: LookupReply) -> LookupReply:
    """No lower tier read back for this LOOKUP: every hit was in memory."""
    reply.hit_tiers = [[hit, 0, 0] for hit in reply.hits]
    return reply


def _split(hits: list[int], in_memory: list[int], after_disk: list[int] | None
           ) -> list[list[int]]:
    """Per item [in memory, from disk, from L2]: its leading chunks in memory before the
    read-backs, then those in memory after the disk's (None: L2 pulled nothing), then the
    rest of its hits."""
    tiers = []
    for i, hit in enumerate(hits):
        memory = min(in_memory[i], hit)
        disk = hit - memory if after_disk is None else max(memory, min(after_disk[i], hit)) - memory
        tiers.append([memory, disk, hit - memory - disk])
    return tiers
