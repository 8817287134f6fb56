"""Scheduler-side request bookkeeping: which chunks each step retrieves, stores and releases."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..protocol import SKIP_BLOCK, LeaseRef, TransferItem
from . import hashing


@dataclass(frozen=True)
class ChunkLayout:
    """How the engine's KV blocks group into the server's chunks."""

    block_size: int  # tokens per engine block (vLLM's cache_config.block_size)
    chunk_size: int  # tokens per server chunk (HELLO's chunk_size; default 256)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.chunk_size < 1:
            raise ValueError(f"block_size and chunk_size must be positive, got "
                             f"{self.block_size} and {self.chunk_size}")
        if self.chunk_size % self.block_size:
            raise ValueError(f"chunk_size {self.chunk_size} must be a multiple of "
                             f"block_size {self.block_size}")

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    def floor_to_chunk(self, num_blocks: int) -> int:
        """The most blocks, at most num_blocks, that make whole chunks."""
        return num_blocks - num_blocks % self.blocks_per_chunk


@dataclass(frozen=True)
class StoreSpec:
    """Chunks a request's workers copy to the server after this step's forward pass.

    chunk_hashes[i] is the chunk at index first_chunk_index + i of the prompt, and its
    blocks are block_ids[i * blocks_per_chunk:(i + 1) * blocks_per_chunk]. parent_hash is
    the prompt's chunk before chunk_hashes[0] (empty for the first): with it the server
    evicts the prompt's later chunks first, whichever STORE brought them.
    """

    request_id: str
    cache_salt: str
    chunk_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    first_chunk_index: int
    parent_hash: bytes = b""

    def transfer_item(self) -> TransferItem:
        return TransferItem.build(self.request_id, list(self.chunk_hashes),
                                  list(self.block_ids), self.cache_salt, self.parent_hash)


@dataclass(frozen=True)
class RetrieveSpec:
    """Chunks a request's workers copy from the server into its blocks before this step's forward.

    A chunk is the unit of storage, so whole chunks are read, from the chunk that holds
    the first block the engine's own prefix cache lacks to the end of our hit. The first
    `skip_leading_blocks` of `block_ids` are blocks the engine already has (possibly
    shared with other running requests): they must never be written. The last
    `skip_trailing_blocks` blocks of the chunks read have no block of the request at all:
    the engine allocates blocks for the tokens it takes from us, and when we hold the
    whole prompt it computes the last token itself (with a block of one token, the last
    block is not allocated yet). `block_ids` lists the request's blocks as they are;
    `target_block_ids` has SKIP_BLOCK in place of both kinds.
    """

    request_id: str
    cache_salt: str
    chunk_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]  # the request's blocks in the chunks read, the engine's own included
    first_chunk_index: int
    skip_leading_blocks: int  # < blocks_per_chunk: only the first chunk overlaps the engine's hit
    skip_trailing_blocks: int = 0  # blocks of the last chunk beyond the request's allocation

    @property
    def loaded_block_ids(self) -> tuple[int, ...]:
        """The blocks this retrieve fills: the ones to report if the load fails."""
        return self.block_ids[self.skip_leading_blocks:]

    @property
    def target_block_ids(self) -> list[int]:
        """Every block of the chunks read, SKIP_BLOCK where nothing may or can be written."""
        return ([SKIP_BLOCK] * self.skip_leading_blocks + list(self.loaded_block_ids)
                + [SKIP_BLOCK] * self.skip_trailing_blocks)

    def transfer_item(self) -> TransferItem:
        """The RETRIEVE item; the server must support SKIP_BLOCK when any block is skipped."""
        return TransferItem.build(self.request_id, list(self.chunk_hashes),
                                  self.target_block_ids, self.cache_salt)


@dataclass(frozen=True)
class StepPlan:
    """What one scheduler step asks of the workers and of the scheduler for one request."""

    retrieve: RetrieveSpec | None = None  # workers: before the forward pass
    store: StoreSpec | None = None  # workers: after the forward pass
    release: LeaseRef | None = None  # scheduler: a lookup's hold that no RETRIEVE will consume
    # workers: blocks the engine expects a load to fill that no chunk covers (report them
    # as failed loads); with or without a retrieve, the step carries the request's load
    unfillable_block_ids: tuple[int, ...] = ()


class Phase(enum.Enum):
    """Where a request stands, as the scheduler sees it (RequestTracker.phase)."""

    WAITING = "waiting"  # looked up (or new, or preempted); not scheduled since
    LOAD_PLANNED = "load planned"  # given blocks for a load that the next step sends
    LOADING = "loading"  # its load went out; the workers have not reported it yet
    RUNNING = "running"  # scheduled: it computes, and stores what it computed
    FREEING = "freeing"  # finished; its blocks wait until its stores have been read
    FINISHED = "finished"


@dataclass
class RequestTracker:
    """One request's bookkeeping in the scheduler process, from its lookup to its end: its
    phase, its blocks, what is computed and stored, its hold and its failed loads, all here.

    One tracker per request, driven by the scheduler side from vLLM's connector hooks, in
    this order: first_chunk_to_look_up / record_lookup (get_num_new_matched_tokens),
    allocate and plan_load (update_state_after_alloc), plan_step (build_connector_meta,
    every step the request is scheduled, and once for a planned load), mark_load_failed /
    load_reported (update_connector_output), finish (request_finished), stores_read.
    Nothing here talks to the server or blocks.

    Phases (Phase): WAITING -> [LOAD_PLANNED ->] LOADING -> RUNNING, or WAITING -> RUNNING
    without a load; a new lookup (vLLM asks again after a preemption) goes back to
    WAITING; finish() ends in
    FREEING (stores were sent: vLLM keeps the blocks until they are read) or FINISHED.

    Counters, all in engine blocks except where named:
    - num_vllm_hit_blocks: the engine's own prefix-cache hit at the last lookup.
    - num_lmcache_hit_blocks: our hit at the last lookup, whole chunks.
    - num_scheduled_tokens: a running total: tokens the engine has scheduled for
      computation since the request was last (re)scheduled from scratch, summed over
      steps (vLLM's per-step num_scheduled_tokens). Together with the hit prefix they
      bound the blocks whose KV is computed once this step's forward pass has run.
    - num_stored_blocks: blocks already on the server or handed to workers to store
      (always whole chunks). It survives preemption so that no chunk is stored twice;
      a STORE the server refuses is not retried, as the cache is best effort.
    """

    request_id: str
    token_ids: Sequence[int] = field(repr=False)  # the prompt; chunks beyond it are never stored
    layout: ChunkLayout
    cache_salt: str = ""
    # per chunk, what else its KV depends on (hashing.chunk_hashes' extra_keys)
    extra_keys: Sequence[bytes] = field(default=(), repr=False)
    phase: Phase = Phase.WAITING
    allocated_block_ids: list[int] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    num_vllm_hit_blocks: int = 0
    num_lmcache_hit_blocks: int = 0
    num_stored_blocks: int = 0
    holds_lease: bool = False  # a lookup held chunks for this request and nothing consumed the hold
    # the first chunk the last lookup asked about: those before it were in the engine's
    # own hit, so they were neither asked about nor held
    lookup_from_chunk: int = 0
    # a load failed: what is computed is unknown, so nothing more is stored, and our
    # chunks are never offered to the request again
    load_failed: bool = False
    # blocks the engine expects a planned load to fill that no chunk covers: reported
    # as failed with the load
    unfillable_block_ids: tuple[int, ...] = ()
    stores_sent: bool = False  # stores went out since the last lookup
    chunk_hashes: tuple[bytes, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = tuple(self.token_ids)  # the hashes below must keep describing them
        self.chunk_hashes = tuple(hashing.chunk_hashes(self.token_ids, self.layout.chunk_size,
                                                       self.extra_keys))

    # -- derived -------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.phase in (Phase.FREEING, Phase.FINISHED)

    @property
    def awaiting_first_step(self) -> bool:
        """Looked up (or preempted), and no step has planned for it since."""
        return self.phase in (Phase.WAITING, Phase.LOAD_PLANNED)

    @property
    def num_token_blocks(self) -> int:
        """Blocks the prompt fills completely."""
        return len(self.token_ids) // self.layout.block_size

    @property
    def num_tokens_to_load(self) -> int:
        """Tokens our hit adds beyond the engine's own hit: get_num_new_matched_tokens' answer.

        When we hold the whole prompt, the last token is left out: the engine must
        compute at least one token to sample from (it is loaded all the same, as part of
        its chunk, if its block is allocated, and computed again into the same slot).
        """
        block_size = self.layout.block_size
        ours = min(self.num_lmcache_hit_blocks * block_size, len(self.token_ids) - 1)
        return max(0, ours - self.num_vllm_hit_blocks * block_size)

    @property
    def lease(self) -> LeaseRef:
        """The server's name for the holds a lookup of this request takes."""
        return LeaseRef(self.request_id, self.cache_salt)

    # -- the scheduler's hooks -----------------------------------------------------------

    def first_chunk_to_look_up(self, num_vllm_hit_tokens: int) -> int:
        """The chunk a lookup starts at: the first one the engine's own hit does not cover
        completely. The chunks before it need no hold and count as no hit on the server;
        the hashes are chained, so a hit from there still names this whole prefix."""
        return num_vllm_hit_tokens // self.layout.chunk_size

    def record_lookup(self, *, num_vllm_hit_tokens: int, num_lmcache_hit_chunks: int,
                      from_chunk: int = 0, held: bool | None = None) -> int:
        """Scheduler, in get_num_new_matched_tokens, after LOOKUP; returns num_tokens_to_load.

        num_vllm_hit_tokens is vLLM's num_computed_tokens argument (its own prefix-cache
        hit, whole blocks); num_lmcache_hit_chunks is LOOKUP's answer for the prompt's
        chunk hashes from `from_chunk` on (held): leading chunks stored from there. A
        request whose load failed is offered nothing (its answer is taken as 0).
        vLLM asks only about waiting requests, new or preempted, and recomputes either
        from scratch into new blocks: so a lookup starts the request's scheduling afresh,
        keeping only num_stored_blocks (what was stored stays stored and is not stored
        again). It may come again, step after
        step, while the engine has no room for the request: the last lookup counts (the
        server replaces the earlier hold). `held`: whether the server holds chunks for the
        request now (default: whether the LOOKUP hit, as a held LOOKUP that hits holds).
        """
        self._check_open("record_lookup")
        block_size = self.layout.block_size
        # No upper bound: after a preemption the engine's hit may cover generated tokens too.
        if num_vllm_hit_tokens < 0 or num_vllm_hit_tokens % block_size:
            raise ValueError(f"request {self.request_id!r}: the engine's hit of "
                             f"{num_vllm_hit_tokens} tokens must be whole blocks of {block_size}")
        if not 0 <= from_chunk <= len(self.chunk_hashes):
            raise ValueError(f"request {self.request_id!r}: a lookup from chunk {from_chunk}, "
                             f"but the prompt has {len(self.chunk_hashes)} full chunks")
        if not 0 <= num_lmcache_hit_chunks <= len(self.chunk_hashes) - from_chunk:
            raise ValueError(f"request {self.request_id!r}: a hit of {num_lmcache_hit_chunks} "
                             f"chunks, but the prompt has {len(self.chunk_hashes)} full chunks")
        self._restart()
        # the server leases nothing on a miss
        self.holds_lease = num_lmcache_hit_chunks > 0 if held is None else held
        self.lookup_from_chunk = from_chunk
        self.num_vllm_hit_blocks = num_vllm_hit_tokens // block_size
        if self.load_failed or self.num_vllm_hit_blocks < from_chunk * self.layout.blocks_per_chunk:
            # The chunks before `from_chunk` were taken for the engine's; if it no longer
            # has them, our chunks after them are no prefix we can load.
            num_lmcache_hit_chunks = 0
        hit = from_chunk + num_lmcache_hit_chunks if num_lmcache_hit_chunks else 0
        self.num_lmcache_hit_blocks = hit * self.layout.blocks_per_chunk
        return self.num_tokens_to_load

    def allocate(self, new_block_ids: Sequence[int]) -> None:
        """Scheduler, when the engine gives the request blocks: appends them in order.

        The first time after a lookup or a preemption, pass every block of the request
        (vLLM's NewRequestData.block_ids, or the block ids of a request resumed from
        preemption), prefix-cache hits included; after that, each step's new_block_ids.
        """
        self._check_open("allocate")
        self.allocated_block_ids.extend(new_block_ids)

    def plan_load(self, unfillable_block_ids: Sequence[int] = ()) -> None:
        """Scheduler, in update_state_after_alloc, when the engine took tokens from us: the
        next plan_step (the next build_connector_meta) sends the load."""
        self._check_open("plan_load")
        self.phase = Phase.LOAD_PLANNED
        self.unfillable_block_ids = tuple(unfillable_block_ids)

    def plan_step(self, num_scheduled_tokens: int) -> StepPlan:
        """Scheduler, in build_connector_meta, once for every step that schedules the request.

        num_scheduled_tokens is this step's count (vLLM's scheduler_output
        .num_scheduled_tokens[request_id]); the tracker adds it to its running total.

        Retrieve, on the first step after a lookup only: the chunks from the one that
        holds block num_vllm_hit_blocks up to our hit, when our hit adds tokens; the
        request is LOADING from here, else RUNNING.
        Store: blocks up to min(num_token_blocks, allocated blocks,
        num_scheduled_tokens // block_size + max(num_vllm_hit_blocks,
        num_lmcache_hit_blocks)) floored to whole chunks, beyond num_stored_blocks, unless
        a load of the request failed. The two hits are overlapping prefixes of the same
        prompt, so their maximum, not their sum, is what is computed before this step's
        tokens.
        """
        self._check_open("plan_step")
        if num_scheduled_tokens < 0:
            raise ValueError(f"request {self.request_id!r}: num_scheduled_tokens "
                             f"{num_scheduled_tokens} is negative")
        self.num_scheduled_tokens += num_scheduled_tokens
        retrieve = release = None
        unfillable: tuple[int, ...] = ()
        if self.awaiting_first_step:
            retrieve = self._retrieve_spec()
            unfillable, self.unfillable_block_ids = self.unfillable_block_ids, ()
            loads = retrieve is not None or self.phase is Phase.LOAD_PLANNED
            self.phase = Phase.LOADING if loads else Phase.RUNNING
            if retrieve is None and self.holds_lease:
                release = self.lease
            self.holds_lease = False  # from here the workers' RETRIEVE or the scheduler drops it
            # Chunks of our hit are on the server already, whether we load them or not (and
            # the blocks of those we load are written while this step runs: never stored).
            self.num_stored_blocks = max(self.num_stored_blocks, self.num_lmcache_hit_blocks)
        return StepPlan(retrieve, self._store_spec(), release, unfillable)

    def mark_load_failed(self) -> None:
        """Scheduler, when a worker reports blocks of the request's load as not loaded: from
        here it stores nothing and is offered no chunk of ours."""
        self.load_failed = True

    def load_reported(self) -> None:
        """Scheduler, when every worker has reported the load finished (landed or not)."""
        if self.phase is Phase.LOADING:
            self.phase = Phase.RUNNING

    def drop_hold(self) -> LeaseRef | None:
        """Scheduler, when no RETRIEVE will consume the last lookup's hold: the hold, if the
        request has one, for the caller to release now; the tracker forgets it."""
        lease = self.lease if self.holds_lease else None
        self.holds_lease = False
        return lease

    def finish(self) -> LeaseRef | None:
        """Scheduler, in request_finished (done, aborted, even before any allocation).

        Returns the hold the last lookup took if no RETRIEVE will consume it: the
        scheduler releases it (RELEASE, or END_SESSION), else it pins chunks until the
        lease times out. The request is FREEING if stores went out since its last
        lookup (the engine frees its blocks once they are read: stores_read), else
        FINISHED.
        """
        release = self.lease if self.holds_lease and not self.finished else None
        self.holds_lease = False
        if not self.finished:
            self.phase = Phase.FREEING if self.stores_sent else Phase.FINISHED
        return release

    def stores_read(self) -> None:
        """Scheduler, when the workers report a FREEING request's stores read."""
        self.phase = Phase.FINISHED

    # -- internals -----------------------------------------------------------------------

    def _check_open(self, hook: str) -> None:
        if self.finished:
            raise RuntimeError(f"request {self.request_id!r}: {hook} after finish")

    def _restart(self) -> None:
        """Forget one scheduling of the request: its blocks, and what it computed in them."""
        self.allocated_block_ids = []
        self.num_scheduled_tokens = 0
        self.phase = Phase.WAITING
        self.unfillable_block_ids = ()
        self.stores_sent = False

    def _chunk_slice(self, start_block: int, end_block: int) -> tuple[bytes, ...]:
        per_chunk = self.layout.blocks_per_chunk
        return self.chunk_hashes[start_block // per_chunk:end_block // per_chunk]

    def _retrieve_spec(self) -> RetrieveSpec | None:
        to_load = self.num_tokens_to_load
        if to_load == 0:
            return None
        first_missing = self.num_vllm_hit_blocks
        start = self.layout.floor_to_chunk(first_missing)
        end = self.num_lmcache_hit_blocks
        # The engine allocates blocks for the tokens it takes, which may end one block
        # short of our hit (the last token of a whole-prompt hit, blocks of one token).
        needed = first_missing + -(-to_load // self.layout.block_size)
        allocated = len(self.allocated_block_ids)
        if allocated < needed:
            raise ValueError(f"request {self.request_id!r}: {needed} blocks must be allocated "
                             f"to load our hit, got {allocated}")
        return RetrieveSpec(
            self.request_id, self.cache_salt, self._chunk_slice(start, end),
            tuple(self.allocated_block_ids[start:min(end, allocated)]),
            first_chunk_index=start // self.layout.blocks_per_chunk,
            skip_leading_blocks=first_missing - start,
            skip_trailing_blocks=max(0, end - allocated))

    def _store_spec(self) -> StoreSpec | None:
        if self.load_failed:
            return None
        computed = (self.num_scheduled_tokens // self.layout.block_size
                    + max(self.num_vllm_hit_blocks, self.num_lmcache_hit_blocks))
        end = self.layout.floor_to_chunk(
            min(self.num_token_blocks, len(self.allocated_block_ids), computed))
        start = self.num_stored_blocks
        if end <= start:
            return None
        self.num_stored_blocks = end
        self.stores_sent = True
        first_chunk = start // self.layout.blocks_per_chunk
        return StoreSpec(
            self.request_id, self.cache_salt, self._chunk_slice(start, end),
            tuple(self.allocated_block_ids[start:end]), first_chunk_index=first_chunk,
            parent_hash=self.chunk_hashes[first_chunk - 1] if first_chunk else b"")
