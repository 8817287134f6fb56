"""LOOKUP: each item's longest stored prefix, held if asked, after the lower tiers' bounded
read-backs (the disk tier's, then L2's)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

from ... import phases
from ...errors import BadRequest
from ...protocol import (
    CHUNK_HASH_BYTES,
    LOOKUP_SLICE_PROBES,
    MAX_LOOKUP_PROBES,
    WORKER_ID_BYTES,
    LookupReply,
    LookupRequest,
    check_hashes,
    split_hashes,
    unpack_worker_ids,
    validate_salt,
)
from ..cache.chunk import LeaseOwner
from ..cache.scan import PrefixScan, resident_hit
from ..net.access import Session
from .answer import Answer
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
                 ) -> Answer | Awaitable[LookupReply]:
        # The decoder checked every field's range and length (protocol/messages.py).
        probes = chunks_named(req.items, self.ctx.config.max_chunks_per_message) \
            * req.kv_world_size
        if probes > MAX_LOOKUP_PROBES:
            raise BadRequest(f"`items`: {probes} index probes (chunk hashes times kv_world_size "
                             f"{req.kv_world_size}) in one LOOKUP; the limit is "
                             f"{MAX_LOOKUP_PROBES}")
        snapshot = _snapshot_workers(req)
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
        if self.ctx.lower:
            items = [(salt, hashes) for salt, hashes, _ in parsed]
            for first, tier in enumerate(self.ctx.lower):
                pull = tier.before_lookup(req.model, req.kv_world_size, items, snapshot)
                if pull is not None:
                    in_memory = (self._resident(req, snapshot, items, probes) if req.tiers
                                 else None)
                    return self._after_pulls(pull, first, req, snapshot, parsed, items, probes,
                                             in_memory)
        answer = self._now(req, snapshot, parsed, probes)
        if not req.tiers:
            return answer
        if isinstance(answer, Answer):
            _in_memory(answer.reply)
            return answer
        return self._sliced_in_memory(answer)

    def _now(self, req: LookupRequest, snapshot: frozenset[int], parsed: Parsed, probes: int
             ) -> Answer | Awaitable[LookupReply]:
        """The hits in memory now: probed at once, the holds and refreshes after the reply
        (ChunkStore.answer_many); a LOOKUP of many probes in slices."""
        if probes > LOOKUP_SLICE_PROBES:
            return self._sliced(req, snapshot, parsed)
        stamp = phases.now() if phases.enabled else 0
        hits, settle = self.ctx.store.answer_many(req.model, req.kv_world_size, parsed, snapshot)
        if phases.enabled:
            phases.add("LOOKUP", "server index", stamp, probes)
            settle = partial(_timed_settle, settle, probes)
        return Answer(LookupReply(hits), settle)

    def _resident(self, req: LookupRequest, snapshot: frozenset[int],
                  items: list[tuple[str, tuple[bytes, ...]]], probes: int) -> list[int] | None:
        """Per item, its leading chunks in memory before a lower tier reads back (one more
        probe per chunk hash and kv worker); None for a LOOKUP too large to probe at once:
        its hits' tiers are not counted."""
        if probes > LOOKUP_SLICE_PROBES:
            return None
        return self._runs(req, snapshot, items)

    def _runs(self, req: LookupRequest, snapshot: frozenset[int],
              items: list[tuple[str, tuple[bytes, ...]]]) -> list[int]:
        store = self.ctx.store
        return [resident_hit(store, req.model, req.kv_world_size, salt, hashes, snapshot)
                for salt, hashes in items]

    @staticmethod
    async def _sliced_in_memory(reply: Awaitable[LookupReply]) -> LookupReply:
        """A sliced LOOKUP for which no lower tier read back: every hit was in memory."""
        return _in_memory(await reply)

    async def _after_pulls(self, pull: Awaitable[None], first: int, req: LookupRequest,
                           snapshot: frozenset[int], parsed: Parsed,
                           items: list[tuple[str, tuple[bytes, ...]]], probes: int,
                           in_memory: list[int] | None) -> LookupReply:
        """Look in memory once the lower tiers' chunks have landed there (or their bounded
        waits are over): `pull` is the `first`th lower tier's; each tier after it is asked
        for the rest once the one before it is done."""
        # Each pulling tier's place in hit_tiers, and each item's run in memory before it.
        starts: list[tuple[int, list[int]]] = []
        if in_memory is not None:
            starts.append((self.ctx.lower[first].hit_column, in_memory))
        await pull
        for tier in self.ctx.lower[first + 1:]:
            next_pull = tier.before_lookup(req.model, req.kv_world_size, items, snapshot)
            if next_pull is not None:
                if starts:
                    starts.append((tier.hit_column, self._runs(req, snapshot, items)))
                await next_pull
        answer = self._now(req, snapshot, parsed, probes)
        if isinstance(answer, Answer):
            answer.then()  # nothing else ran since its probes
            done = answer.reply
        else:
            done = await answer
        if starts:
            done.hit_tiers = _split(done.hits, starts)
        return done

    async def _sliced(self, req: LookupRequest, snapshot: frozenset[int], parsed: Parsed
                      ) -> LookupReply:
        """A LOOKUP of many probes, LOOKUP_SLICE_PROBES at a time between other clients'
        requests; each item's chunks stay held between its slices."""
        scans = [(PrefixScan(self.ctx.store, req.model, req.kv_world_size, salt, hashes,
                             hold_while_scanning=True, snapshot_workers=snapshot), holder)
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


def _snapshot_workers(req: LookupRequest) -> frozenset[int]:
    """The LOOKUP's snapshot workers, checked: kv workers of its kv world, each named once,
    and not all of them (a hit needs a run of some worker's chunks)."""
    packed = req.snapshot_workers
    if not packed:
        return frozenset()
    if len(packed) > WORKER_ID_BYTES * req.kv_world_size:  # checked before it is unpacked
        raise BadRequest(f"`snapshot_workers`: {len(packed)} bytes, more than "
                         f"{req.kv_world_size} kv worker ids")
    named = unpack_worker_ids(packed, "snapshot_workers")
    workers = frozenset(named)
    if len(workers) != len(named):
        raise BadRequest("`snapshot_workers`: a kv worker id is named twice")
    if max(workers) >= req.kv_world_size:
        raise BadRequest(f"`snapshot_workers`: kv worker id {max(workers)} is not below "
                         f"kv_world_size {req.kv_world_size}")
    if len(workers) == req.kv_world_size:
        raise BadRequest("`snapshot_workers`: every kv worker is named; at least one must "
                         "not be a snapshot worker")
    return workers


def _timed_settle(settle: Callable[[], None], probes: int) -> None:
    stamp = phases.now()
    settle()
    phases.add("LOOKUP", "server settle", stamp, probes)


def _in_memory(reply: LookupReply) -> LookupReply:
    """No lower tier read back for this LOOKUP: every hit was in memory."""
    reply.hit_tiers = [[hit, 0, 0] for hit in reply.hits]
    return reply


def _split(hits: list[int], starts: list[tuple[int, list[int]]]) -> list[list[int]]:
    """Per item [in memory, from disk, from L2]: its leading chunks in memory before the
    first lower tier's pull, then each pulling tier's (at its hit column): from where the
    run in memory stood before its pull to where it stood before the next tier's (the last
    tier's: to the item's hits). `starts`: per pulling tier, in order, its hit column and
    each item's run in memory before its pull (a run that shrank meanwhile, by evictions,
    counts as the longer one before it)."""
    tiers = []
    for i, hit in enumerate(hits):
        row = [0, 0, 0]
        marks: list[int] = []
        for _, runs in starts:
            marks.append(max(marks[-1] if marks else 0, min(runs[i], hit)))
        marks.append(hit)
        row[0] = marks[0]
        for (column, _), begin, end in zip(starts, marks, marks[1:]):
            row[column] = end - begin
        tiers.append(row)
    return tiers
