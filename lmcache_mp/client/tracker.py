"""Scheduler-side request bookkeeping: which chunks each step retrieves, stores and releases."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..protocol import SKIP_BLOCK, LeaseRef, LookupItem, TransferItem
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
    blocks are block_ids[i * blocks_per_chunk:(i + 1) * blocks_per_chunk].
    """

    request_id: str
    cache_salt: str
    chunk_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    first_chunk_index: int

    def transfer_item(self) -> TransferItem:
        return TransferItem.build(self.request_id, list(self.chunk_hashes),
                                  list(self.block_ids), self.cache_salt)


@dataclass(frozen=True)
class RetrieveSpec:
    """Chunks a request's workers copy from the server into its blocks before this step's forward.

    A chunk is the unit of storage, so whole chunks are read, from the chunk that holds
    the first block the engine's own prefix cache lacks to the end of our hit. The first
    `skip_leading_blocks` of `block_ids` are blocks the engine already has (possibly
    shared with other running requests): they must never be written. `block_ids` lists
    them as they are; `target_block_ids` has SKIP_BLOCK in their place.
    """

    request_id: str
    cache_salt: str
    chunk_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]  # every block of the chunks read, the engine's own included
    first_chunk_index: int
    skip_leading_blocks: int  # < blocks_per_chunk: only the first chunk overlaps the engine's hit

    @property
    def loaded_block_ids(self) -> tuple[int, ...]:
        """The blocks this retrieve fills: the ones to report if the load fails."""
        return self.block_ids[self.skip_leading_blocks:]

    @property
    def target_block_ids(self) -> list[int]:
        """block_ids with SKIP_BLOCK for each block the engine already holds."""
        return [SKIP_BLOCK] * self.skip_leading_blocks + list(self.loaded_block_ids)

    def transfer_item(self) -> TransferItem:
        """The RETRIEVE item; a server must support SKIP_BLOCK when skip_leading_blocks > 0."""
        return TransferItem.build(self.request_id, list(self.chunk_hashes),
                                  self.target_block_ids, self.cache_salt)


@dataclass(frozen=True)
class StepPlan:
    """What one scheduler step asks of the workers and of the scheduler for one request."""

    retrieve: RetrieveSpec | None = None  # workers: before the forward pass
    store: StoreSpec | None = None  # workers: after the forward pass
    release: LeaseRef | None = None  # scheduler: a lookup's hold that no RETRIEVE will consume


@dataclass
class RequestTracker:
    """One request's bookkeeping in the scheduler process, from its lookup to its end.

    One tracker per request, driven by the scheduler-side adapter from vLLM's connector
    hooks, in this order: lookup_item / record_lookup (get_num_new_matched_tokens),
    allocate (update_state_after_alloc or build_connector_meta), plan_step
    (build_connector_meta, every step the request is scheduled), preempt, finish
    (request_finished). Nothing here talks to the server or blocks.

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
    allocated_block_ids: list[int] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    num_vllm_hit_blocks: int = 0
    num_lmcache_hit_blocks: int = 0
    num_stored_blocks: int = 0
    holds_lease: bool = False  # a lookup held chunks for this request and nothing consumed the hold
    awaiting_first_step: bool = True  # looked up (or preempted), not yet scheduled
    finished: bool = False
    chunk_hashes: tuple[bytes, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = tuple(self.token_ids)  # the hashes below must keep describing them
        self.chunk_hashes = tuple(hashing.chunk_hashes(self.token_ids, self.layout.chunk_size))

    # -- derived -------------------------------------------------------------------------

    @property
    def num_token_blocks(self) -> int:
        """Blocks the prompt fills completely."""
        return len(self.token_ids) // self.layout.block_size

    @property
    def num_tokens_to_load(self) -> int:
        """Tokens our hit adds beyond the engine's own hit: get_num_new_matched_tokens' answer.

        When we hold the whole prompt, the last token is left out: the engine must
        compute at least one token to sample from (it is loaded all the same, as part of
        its chunk, and computed again into the same slot).
        """
        block_size = self.layout.block_size
        ours = min(self.num_lmcache_hit_blocks * block_size, len(self.token_ids) - 1)
        return max(0, ours - self.num_vllm_hit_blocks * block_size)

    @property
    def lease(self) -> LeaseRef:
        """The server's name for the holds a lookup of this request takes."""
        return LeaseRef(self.request_id, self.cache_salt)

    # -- the scheduler's hooks -----------------------------------------------------------

    def lookup_item(self) -> LookupItem:
        """Scheduler, in get_num_new_matched_tokens, before LOOKUP: the whole prompt, held.

        The hold keeps the chunks found from eviction until the workers' RETRIEVE
        (which releases it) or the scheduler's RELEASE of what plan_step or finish
        returns.
        """
        return LookupItem.build(self.request_id, list(self.chunk_hashes), self.cache_salt,
                                hold=True)

    def record_lookup(self, *, num_vllm_hit_tokens: int, num_lmcache_hit_chunks: int) -> int:
        """Scheduler, in get_num_new_matched_tokens, after LOOKUP; returns num_tokens_to_load.

        num_vllm_hit_tokens is vLLM's num_computed_tokens argument (its own prefix-cache
        hit, whole blocks); num_lmcache_hit_chunks is LOOKUP's answer for lookup_item().
        vLLM asks only about waiting requests, new or preempted, and recomputes either
        from scratch into new blocks: so a lookup starts the request's scheduling afresh,
        as preempt() does, keeping only num_stored_blocks. It may come again, step after
        step, while the engine has no room for the request: the last lookup counts (the
        server replaces the earlier hold).
        """
        self._check_open("record_lookup")
        block_size = self.layout.block_size
        # No upper bound: after a preemption the engine's hit may cover generated tokens too.
        if num_vllm_hit_tokens < 0 or num_vllm_hit_tokens % block_size:
            raise ValueError(f"request {self.request_id!r}: the engine's hit of "
                             f"{num_vllm_hit_tokens} tokens must be whole blocks of {block_size}")
        if not 0 <= num_lmcache_hit_chunks <= len(self.chunk_hashes):
            raise ValueError(f"request {self.request_id!r}: a hit of {num_lmcache_hit_chunks} "
                             f"chunks, but the prompt has {len(self.chunk_hashes)} full chunks")
        self._restart()
        self.num_vllm_hit_blocks = num_vllm_hit_tokens // block_size
        self.num_lmcache_hit_blocks = num_lmcache_hit_chunks * self.layout.blocks_per_chunk
        self.holds_lease = num_lmcache_hit_chunks > 0  # the server leases nothing on a miss
        return self.num_tokens_to_load

    def allocate(self, new_block_ids: Sequence[int]) -> None:
        """Scheduler, when the engine gives the request blocks: appends them in order.

        The first time after a lookup or a preemption, pass every block of the request
        (vLLM's NewRequestData.block_ids, or the block ids of a request resumed from
        preemption), prefix-cache hits included; after that, each step's new_block_ids.
        """
        self._check_open("allocate")
        self.allocated_block_ids.extend(new_block_ids)

    def plan_step(self, num_scheduled_tokens: int) -> StepPlan:
        """Scheduler, in build_connector_meta, once for every step that schedules the request.

        num_scheduled_tokens is this step's count (vLLM's scheduler_output
        .num_scheduled_tokens[request_id]); the tracker adds it to its running total.

        Retrieve, on the first step after a lookup only: the chunks from the one that
        holds block num_vllm_hit_blocks up to our hit, when our hit adds tokens.
        Store: blocks up to min(num_token_blocks, allocated blocks,
        num_scheduled_tokens // block_size + max(num_vllm_hit_blocks,
        num_lmcache_hit_blocks)) floored to whole chunks, beyond num_stored_blocks. The
        two hits are overlapping prefixes of the same prompt, so their maximum, not
        their sum, is what is computed before this step's tokens.
        """
        self._check_open("plan_step")
        if num_scheduled_tokens < 0:
            raise ValueError(f"request {self.request_id!r}: num_scheduled_tokens "
                             f"{num_scheduled_tokens} is negative")
        self.num_scheduled_tokens += num_scheduled_tokens
        retrieve = release = None
        if self.awaiting_first_step:
            self.awaiting_first_step = False
            retrieve = self._retrieve_spec()
            if retrieve is None and self.holds_lease:
                release = self.lease
            self.holds_lease = False  # from here the workers' RETRIEVE or the scheduler drops it
            # Chunks of our hit are on the server already, whether we load them or not.
            self.num_stored_blocks = max(self.num_stored_blocks, self.num_lmcache_hit_blocks)
        return StepPlan(retrieve, self._store_spec(), release)

    def preempt(self) -> LeaseRef | None:
        """Scheduler, when the engine preempts the request: returns a hold to release, if any.

        vLLM frees the request's blocks and later schedules it again from scratch with
        new block ids, after a new lookup (which also does what this does). What was
        stored stays stored and is not stored again; the new lookup finds it.
        """
        self._check_open("preempt")
        release = self.lease if self.holds_lease else None
        self._restart()
        self.num_vllm_hit_blocks = self.num_lmcache_hit_blocks = 0
        self.holds_lease = False
        return release

    def finish(self) -> LeaseRef | None:
        """Scheduler, in request_finished (done, aborted, even before any allocation).

        Returns the hold the last lookup took if no RETRIEVE will consume it: the
        scheduler releases it (RELEASE, or END_SESSION), else it pins chunks until the
        lease times out.
        """
        release = self.lease if self.holds_lease and not self.finished else None
        self.holds_lease = False
        self.finished = True
        return release

    # -- internals -----------------------------------------------------------------------

    def _check_open(self, hook: str) -> None:
        if self.finished:
            raise RuntimeError(f"request {self.request_id!r}: {hook} after finish")

    def _restart(self) -> None:
        """Forget one scheduling of the request: its blocks, and what it computed in them."""
        self.allocated_block_ids = []
        self.num_scheduled_tokens = 0
        self.awaiting_first_step = True

    def _chunk_slice(self, start_block: int, end_block: int) -> tuple[bytes, ...]:
        per_chunk = self.layout.blocks_per_chunk
        return self.chunk_hashes[start_block // per_chunk:end_block // per_chunk]

    def _retrieve_spec(self) -> RetrieveSpec | None:
        if self.num_tokens_to_load == 0:
            return None
        first_missing = self.num_vllm_hit_blocks
        start = self.layout.floor_to_chunk(first_missing)
        end = self.num_lmcache_hit_blocks
        if len(self.allocated_block_ids) < end:
            raise ValueError(f"request {self.request_id!r}: {end} blocks must be allocated to "
                             f"load our hit, got {len(self.allocated_block_ids)}")
        return RetrieveSpec(
            self.request_id, self.cache_salt, self._chunk_slice(start, end),
            tuple(self.allocated_block_ids[start:end]),
            first_chunk_index=start // self.layout.blocks_per_chunk,
            skip_leading_blocks=first_missing - start)

    def _store_spec(self) -> StoreSpec | None:
        computed = (self.num_scheduled_tokens // self.layout.block_size
                    + max(self.num_vllm_hit_blocks, self.num_lmcache_hit_blocks))
        end = self.layout.floor_to_chunk(
            min(self.num_token_blocks, len(self.allocated_block_ids), computed))
        start = self.num_stored_blocks
        if end <= start:
            return None
        self.num_stored_blocks = end
        return StoreSpec(
            self.request_id, self.cache_salt, self._chunk_slice(start, end),
            tuple(self.allocated_block_ids[start:end]),
            first_chunk_index=start // self.layout.blocks_per_chunk)
