"""RequestTracker: the chunks each scheduler step retrieves and stores, and holds it releases."""

import pytest
import torch

from lmcache_mp.client import StoreStatus
from lmcache_mp.client.tracker import (
    SKIP_BLOCK,
    ChunkLayout,
    Phase,
    RequestTracker,
    RetrieveSpec,
    StepPlan,
    StoreSpec,
)
from lmcache_mp.protocol import LeaseRef, LookupItem, unpack_block_ids, unpack_hashes

from ..workers import BLOCKS_PER_CHUNK, MODEL, expected_blocks, make_cache

LAYOUT = ChunkLayout(block_size=16, chunk_size=256)  # 16 blocks per chunk
PER_CHUNK = LAYOUT.blocks_per_chunk
SALT = "tenant-a"
PROMPT_TOKENS = 1600  # 100 blocks: 6 full chunks (96 blocks) and 4 blocks more
ENGINE_BLOCKS = list(range(1000, 1200))  # the ids the engine hands the request, in order


def tokens(tag: int, count: int) -> list[int]:
    return [(tag * 7919 + i) % 50000 for i in range(count)]


def make_tracker(num_tokens: int = PROMPT_TOKENS, request_id: str = "req", tag: int = 1,
                 cache_salt: str = SALT) -> RequestTracker:
    return RequestTracker(request_id, tokens(tag, num_tokens), LAYOUT, cache_salt)


def engine_blocks(start: int, end: int) -> tuple[int, ...]:
    return tuple(ENGINE_BLOCKS[start:end])


def planned_retrieve(plan: StepPlan) -> RetrieveSpec:
    assert plan.retrieve is not None, "the step plans no retrieve"
    return plan.retrieve


def planned_store(plan: StepPlan) -> StoreSpec:
    assert plan.store is not None, "the step plans no store"
    return plan.store


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // LAYOUT.block_size)


def store_spec(tracker, first_chunk, end_chunk, block_ids=ENGINE_BLOCKS) -> StoreSpec:
    return StoreSpec(tracker.request_id, tracker.cache_salt,
                     tracker.chunk_hashes[first_chunk:end_chunk],
                     tuple(block_ids[first_chunk * PER_CHUNK:end_chunk * PER_CHUNK]), first_chunk,
                     tracker.chunk_hashes[first_chunk - 1] if first_chunk else b"")


def retrieve_spec(tracker, first_chunk, end_chunk, skip, block_ids=ENGINE_BLOCKS
                  ) -> RetrieveSpec:
    return RetrieveSpec(tracker.request_id, tracker.cache_salt,
                        tracker.chunk_hashes[first_chunk:end_chunk],
                        tuple(block_ids[first_chunk * PER_CHUNK:end_chunk * PER_CHUNK]),
                        first_chunk, skip)


# -- our hit against the engine's own ---------------------------------------------------

@pytest.mark.parametrize("vllm_blocks, our_chunks, to_load, retrieve, release, store", [
    # ours (32 blocks) below the engine's 44: nothing to load; store from our hit on
    (44, 2, 0, None, True, (2, 6)),
    # ours (48) above the engine's 20: read chunks 1-2, leaving blocks 16-19 alone
    (20, 3, 48 * 16 - 20 * 16, (1, 3, 4), False, (3, 6)),
    # the engine's hit ends on a chunk boundary: nothing to skip
    (16, 4, 48 * 16, (1, 4, 0), False, (4, 6)),
    (0, 4, 64 * 16, (0, 4, 0), False, (4, 6)),
    # equal hits: nothing to load; the hold is released
    (32, 2, 0, None, True, (2, 6)),
    # no hit of ours: no hold was taken; every full chunk is stored, the engine's too
    (0, 0, 0, None, False, (0, 6)),
    (44, 0, 0, None, False, (0, 6)),
])
def test_retrieve_starts_at_the_engines_first_missing_block_and_ends_at_our_hit(
        vllm_blocks, our_chunks, to_load, retrieve, release, store):
    tracker = make_tracker()
    assert tracker.record_lookup(num_vllm_hit_tokens=vllm_blocks * 16,
                                 num_lmcache_hit_chunks=our_chunks) == to_load
    assert (tracker.num_vllm_hit_blocks, tracker.num_lmcache_hit_blocks) == (
        vllm_blocks, our_chunks * PER_CHUNK)
    tracker.allocate(engine_blocks(0, 100))
    computed_tokens = max(vllm_blocks * 16, our_chunks * 256)
    plan = tracker.plan_step(PROMPT_TOKENS - computed_tokens)
    assert plan.retrieve == (retrieve_spec(tracker, *retrieve) if retrieve else None)
    assert plan.release == (LeaseRef("req", SALT) if release else None)
    assert plan.store == store_spec(tracker, *store)
    assert tracker.num_stored_blocks == store[1] * PER_CHUNK
    assert tracker.finish() is None  # the hold went to the retrieve, or was released above


def test_the_engines_blocks_in_the_first_chunk_are_placeholders_in_the_retrieve_item():
    tracker = make_tracker()
    tracker.record_lookup(num_vllm_hit_tokens=20 * 16, num_lmcache_hit_chunks=3)
    tracker.allocate(engine_blocks(0, 100))
    retrieve = planned_retrieve(tracker.plan_step(PROMPT_TOKENS - 48 * 16))
    assert retrieve.block_ids == engine_blocks(16, 48)
    assert retrieve.loaded_block_ids == engine_blocks(20, 48)
    assert retrieve.target_block_ids == [SKIP_BLOCK] * 4 + list(engine_blocks(20, 48))
    item = retrieve.transfer_item()
    assert (item.request_id, item.cache_salt) == ("req", SALT)
    assert unpack_hashes(item.chunk_hashes, "") == list(tracker.chunk_hashes[1:3])
    assert unpack_block_ids(item.block_ids, "") == retrieve.target_block_ids


def test_store_spec_becomes_a_transfer_item():
    tracker = make_tracker()
    tracker.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=0)
    tracker.allocate(engine_blocks(0, 100))
    item = planned_store(tracker.plan_step(PROMPT_TOKENS)).transfer_item()
    assert unpack_hashes(item.chunk_hashes, "") == list(tracker.chunk_hashes)
    assert unpack_block_ids(item.block_ids, "") == list(engine_blocks(0, 96))
    assert item.cache_salt == SALT


@pytest.mark.parametrize("vllm_blocks, to_load, retrieve", [
    (31, 511 - 31 * 16, (1, 2, 15)),  # vLLM itself leaves the last block out of its hit
    (0, 511, (0, 2, 0)),
])
def test_a_whole_prompt_hit_leaves_the_last_token_to_the_engine(vllm_blocks, to_load, retrieve):
    tracker = make_tracker(num_tokens=512)
    assert tracker.record_lookup(num_vllm_hit_tokens=vllm_blocks * 16,
                                 num_lmcache_hit_chunks=2) == to_load
    tracker.allocate(engine_blocks(0, 32))
    plan = tracker.plan_step(512 - vllm_blocks * 16 - to_load)  # one token: the last
    assert plan.retrieve == retrieve_spec(tracker, *retrieve)
    assert plan.store is None  # both chunks came from the server


def test_the_last_lookup_counts_when_the_engine_had_no_room_at_first():
    tracker = make_tracker()
    tracker.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=3)
    assert tracker.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=1) == 256
    tracker.allocate(engine_blocks(0, 100))
    plan = tracker.plan_step(PROMPT_TOKENS - 256)
    assert plan.retrieve == retrieve_spec(tracker, 0, 1, 0)
    assert plan.store == store_spec(tracker, 1, 6)  # chunks 1-2 were not stored by anyone


# -- chunked prefill ----------------------------------------------------------------------

@pytest.mark.parametrize("vllm_blocks, our_chunks, steps", [
    # (tokens scheduled this step, expected stored chunks [first, end) or None)
    (0, 0, [(300, (0, 1)), (500, (1, 3)), (800, (3, 6)), (1, None), (1, None)]),
    (0, 1, [(400, (1, 2)), (400, (2, 4)), (544, (4, 6)), (1, None)]),
    # The hits overlap: after the first step 48 blocks (ours), or 44 (the engine's), plus
    # 16 are computed, not 48 + 20 + 16 or 44 + 32 + 16.
    (20, 3, [(256, (3, 4)), (256, (4, 5)), (320, (5, 6))]),
    (44, 2, [(256, (2, 3)), (640, (3, 6)), (1, None)]),
])
@pytest.mark.parametrize("up_front", [False, True], ids=["blocks-as-needed", "blocks-up-front"])
def test_chunked_prefill_stores_every_full_chunk_exactly_once(vllm_blocks, our_chunks, steps,
                                                               up_front):
    tracker = make_tracker()
    tracker.record_lookup(num_vllm_hit_tokens=vllm_blocks * 16, num_lmcache_hit_chunks=our_chunks)
    hit_tokens = max(vllm_blocks * 16, our_chunks * 256)
    computed = hit_tokens
    allocated = 0
    stored_chunks: list[int] = []
    for step, (scheduled, expected) in enumerate(steps):
        computed += scheduled
        # vLLM allocates blocks as tokens need them; tokens scheduled alone must bound the
        # store when the blocks are there before the tokens are.
        needed = 101 if up_front else blocks_for(computed)
        tracker.allocate(engine_blocks(allocated, max(allocated, needed)))
        allocated = max(allocated, needed)
        plan = tracker.plan_step(scheduled)
        assert tracker.num_scheduled_tokens == computed - hit_tokens
        loads = step == 0 and our_chunks * PER_CHUNK > vllm_blocks
        assert plan.retrieve == (retrieve_spec(tracker, vllm_blocks // PER_CHUNK, our_chunks,
                                               vllm_blocks % PER_CHUNK) if loads else None)
        assert plan.store == (store_spec(tracker, *expected) if expected else None)
        if plan.store:
            stored_chunks += range(plan.store.first_chunk_index,
                                   plan.store.first_chunk_index + len(plan.store.chunk_hashes))
    assert sorted(stored_chunks) == list(range(our_chunks, 6))


def test_allocated_blocks_and_prompt_length_bound_the_store_too():
    tracker = make_tracker()
    tracker.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=0)
    tracker.allocate(engine_blocks(0, 40))  # fewer blocks than the tokens computed
    assert tracker.plan_step(800).store == store_spec(tracker, 0, 2)
    tracker.allocate(engine_blocks(40, 120))  # more blocks than the prompt fills
    assert tracker.plan_step(PROMPT_TOKENS).store == store_spec(tracker, 2, 6)


# -- preemption -----------------------------------------------------------------------------

def test_a_preempted_request_resumes_from_what_it_stored_and_never_stores_it_again():
    tracker = make_tracker()
    tracker.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=0)
    tracker.allocate(engine_blocks(0, 38))
    assert tracker.plan_step(600).store == store_spec(tracker, 0, 2)
    # Preempted: vLLM freed the blocks, but its prefix cache still had the first 8 of them.
    assert tracker.record_lookup(num_vllm_hit_tokens=8 * 16, num_lmcache_hit_chunks=2) == 384
    assert (tracker.phase, tracker.num_scheduled_tokens) == (Phase.WAITING, 0)
    new_blocks = list(range(5000, 5100))
    tracker.allocate(new_blocks)
    plan = tracker.plan_step(PROMPT_TOKENS - 512)
    assert plan.retrieve == retrieve_spec(tracker, 0, 2, 8, new_blocks)
    assert plan.store == store_spec(tracker, 2, 6, new_blocks)


def test_a_chunk_evicted_while_preempted_is_not_stored_again_by_the_same_request():
    tracker = make_tracker()
    tracker.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=0)
    tracker.allocate(engine_blocks(0, 38))
    tracker.plan_step(600)  # then preempted
    tracker.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=1)  # chunk 1 is gone
    tracker.allocate(engine_blocks(100, 200))
    plan = tracker.plan_step(PROMPT_TOKENS - 256)
    assert plan.retrieve == retrieve_spec(tracker, 0, 1, 0, ENGINE_BLOCKS[100:])
    assert plan.store == store_spec(tracker, 2, 6, ENGINE_BLOCKS[100:])


def test_a_resume_whose_engine_hit_covers_generated_tokens_loads_and_stores_nothing():
    tracker = make_tracker()
    tracker.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=0)
    tracker.allocate(engine_blocks(0, 100))
    assert tracker.plan_step(PROMPT_TOKENS).store == store_spec(tracker, 0, 6)
    tracker.plan_step(40)  # decoding
    assert tracker.record_lookup(num_vllm_hit_tokens=102 * 16, num_lmcache_hit_chunks=6) == 0
    tracker.allocate(engine_blocks(100, 203))
    assert tracker.plan_step(8) == StepPlan(release=LeaseRef("req", SALT))


# -- abort and misuse -------------------------------------------------------------------------

def test_an_abort_before_the_first_step_hands_back_the_lookups_hold_once():
    tracker = make_tracker()
    tracker.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=2)
    assert tracker.finish() == LeaseRef("req", SALT)
    assert tracker.finish() is None
    with pytest.raises(RuntimeError, match="'req': plan_step after finish"):
        tracker.plan_step(16)
    missed = make_tracker(request_id="miss")
    missed.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=0)
    assert missed.finish() is None  # the server leases nothing on a miss


def test_bad_inputs_are_refused_clearly():
    with pytest.raises(ValueError, match="chunk_size 250 must be a multiple of block_size 16"):
        ChunkLayout(16, 250)
    tracker = make_tracker()
    with pytest.raises(ValueError, match="hit of 20 tokens must be whole blocks of 16"):
        tracker.record_lookup(num_vllm_hit_tokens=20, num_lmcache_hit_chunks=0)
    with pytest.raises(ValueError, match="hit of -16 tokens must be whole blocks"):
        tracker.record_lookup(num_vllm_hit_tokens=-16, num_lmcache_hit_chunks=0)
    with pytest.raises(ValueError, match="a hit of 7 chunks, but the prompt has 6 full chunks"):
        tracker.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=7)
    tracker.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=3)
    tracker.allocate(engine_blocks(0, 40))
    with pytest.raises(ValueError, match="48 blocks must be allocated to load our hit, got 40"):
        tracker.plan_step(16)


# -- against a real server --------------------------------------------------------------------

NUM_BLOCKS = 8 * BLOCKS_PER_CHUNK


@pytest.fixture
def registered(client, request):
    """A W2 cache of 8 chunks' blocks with random bytes from seed 7, registered."""
    cache = make_cache(NUM_BLOCKS, 7)
    request.addfinalizer(cache.close)
    registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                             block_size=16)
    request.addfinalizer(lambda: client.unregister(registration))
    return cache, registration


def held(tracker, from_chunk: int = 0) -> LookupItem:
    """The LOOKUP item the scheduler sends for the tracker's request: held."""
    return LookupItem.build(tracker.request_id, list(tracker.chunk_hashes[from_chunk:]),
                            tracker.cache_salt, hold=True)


def lookup(client, tracker, *, vllm_blocks: int = 0) -> int:
    (hit,) = client.lookup(MODEL, 1, [held(tracker)])
    return tracker.record_lookup(num_vllm_hit_tokens=vllm_blocks * 16, num_lmcache_hit_chunks=hit)


def store_first_chunks(client, registration, cache_salt: str, num_tokens: int, tag: int) -> None:
    writer = make_tracker(num_tokens, "writer", tag, cache_salt)
    lookup(client, writer)
    writer.allocate(list(range(blocks_for(num_tokens))))
    store = planned_store(writer.plan_step(num_tokens))
    assert client.store(registration, [store.transfer_item()]) == [
        bytes([StoreStatus.STORED] * len(store.chunk_hashes))]
    assert writer.finish() is None


def test_holds_of_aborted_or_unneeded_lookups_are_released_and_none_leak(client, registered):
    _, registration = registered
    salt = "tracker-holds"
    store_first_chunks(client, registration, salt, num_tokens=778, tag=31)  # 3 chunks

    aborted = make_tracker(778, "aborted", 31, salt)
    assert lookup(client, aborted) == 3 * 256
    assert client.stats().leases_held == 1
    assert client.release([aborted.finish()]) == 3  # chunk holds dropped
    assert client.stats().leases_held == 0

    engine_has_more = make_tracker(778, "engine-has-more", 31, salt)
    assert lookup(client, engine_has_more, vllm_blocks=48) == 0
    assert client.stats().leases_held == 1
    engine_has_more.allocate(list(range(49)))
    plan = engine_has_more.plan_step(10)
    assert plan.retrieve is None and plan.store is None and plan.release is not None
    assert client.end_session(plan.release.request_id, plan.release.cache_salt) == 3
    assert engine_has_more.finish() is None
    assert client.stats().leases_held == 0


def test_a_preempted_request_retrieves_what_it_stored_into_its_new_blocks(client, registered):
    cache, registration = registered
    tracker = make_tracker(1124, "preempted", 41, "tracker-resume")  # 4 full chunks
    assert lookup(client, tracker) == 0
    first_blocks = list(range(38))
    tracker.allocate(first_blocks)
    store = planned_store(tracker.plan_step(600))
    assert client.store(registration, [store.transfer_item()]) == [bytes([StoreStatus.STORED] * 2)]

    assert lookup(client, tracker) == 512  # preempted: vLLM asks again
    new_blocks = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - blocks_for(1124), -1))
    tracker.allocate(new_blocks)
    plan = tracker.plan_step(1124 - 512)
    assert client.retrieve(registration, [planned_retrieve(plan).transfer_item()]) == [2]
    assert client.stats().leases_held == 0  # the retrieve consumed the lookup's hold
    assert torch.equal(cache.blocks(new_blocks[:32]).view(torch.uint8),
                       expected_blocks(NUM_BLOCKS, 7, first_blocks[:32]))
    assert planned_store(plan).first_chunk_index == 2  # chunks 0 and 1 are not sent again
    assert client.store(registration, [planned_store(plan).transfer_item()]) == [
        bytes([StoreStatus.STORED] * 2)]
    assert client.lookup(MODEL, 1, [held(tracker)]) == [4]
    assert client.release([tracker.lease]) == 4  # the check above held all four


# -- phases, failed loads, lookups from a later chunk, blocks of one token -----------------

def test_phases_from_lookup_through_load_to_the_stores_being_read():
    tracker = make_tracker()
    assert tracker.phase is Phase.WAITING
    tracker.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=2)
    tracker.allocate(engine_blocks(0, 32))
    tracker.plan_load()
    assert tracker.phase is Phase.LOAD_PLANNED
    plan = tracker.plan_step(0)
    assert plan.retrieve == retrieve_spec(tracker, 0, 2, 0) and plan.store is None
    assert tracker.phase is Phase.LOADING
    tracker.load_reported()
    assert tracker.phase is Phase.RUNNING
    tracker.allocate(engine_blocks(32, 100))
    assert tracker.plan_step(PROMPT_TOKENS - 512).store == store_spec(tracker, 2, 6)
    assert tracker.finish() is None and tracker.phase is Phase.FREEING  # its stores go on
    tracker.stores_read()
    assert tracker.phase is Phase.FINISHED
    missed = make_tracker(request_id="miss")
    missed.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=0)
    missed.finish()
    assert missed.phase is Phase.FINISHED  # stored nothing: nothing to wait for


def test_a_planned_load_that_no_chunk_covers_still_reports_its_blocks():
    tracker = make_tracker()
    tracker.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=0)
    tracker.allocate(engine_blocks(0, 7))
    tracker.plan_load(engine_blocks(0, 7))
    plan = tracker.plan_step(0)
    assert plan.retrieve is None and plan.unfillable_block_ids == engine_blocks(0, 7)
    assert tracker.phase is Phase.LOADING


def test_a_failed_load_stores_nothing_more_and_is_never_offered_our_chunks_again():
    tracker = make_tracker()
    tracker.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=2)
    tracker.allocate(engine_blocks(0, 32))
    tracker.plan_load()
    tracker.plan_step(0)
    tracker.mark_load_failed()
    tracker.load_reported()
    # vLLM recomputes from scratch and asks again: the same chunks are not offered.
    assert tracker.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=2) == 0
    tracker.allocate(engine_blocks(0, 100))
    plan = tracker.plan_step(PROMPT_TOKENS)
    assert plan.retrieve is None and plan.store is None
    assert plan.release == LeaseRef("req", SALT)  # the hold the LOOKUP took goes back


def test_a_lookup_from_a_later_chunk_counts_the_engines_chunks_before_it():
    tracker = make_tracker()
    assert tracker.first_chunk_to_look_up(40 * 16) == 2
    assert tracker.first_chunk_to_look_up(47 * 16) == 2
    assert tracker.record_lookup(num_vllm_hit_tokens=40 * 16, num_lmcache_hit_chunks=2,
                                 from_chunk=2) == (64 - 40) * 16
    tracker.allocate(engine_blocks(0, 100))
    plan = tracker.plan_step(PROMPT_TOKENS - 64 * 16)
    assert plan.retrieve == retrieve_spec(tracker, 2, 4, 8)
    assert plan.store == store_spec(tracker, 4, 6)
    # The engine lost its blocks before the chunk looked up from: no prefix of ours to load.
    again = make_tracker(request_id="again")
    assert again.record_lookup(num_vllm_hit_tokens=16 * 16, num_lmcache_hit_chunks=2,
                               from_chunk=2) == 0
    assert again.holds_lease  # the server held them all the same: released by plan_step


def test_blocks_of_one_token_load_a_whole_prompt_hit_into_one_block_fewer():
    layout = ChunkLayout(block_size=1, chunk_size=256)
    tracker = RequestTracker("one", tokens(3, 512), layout, SALT)
    assert tracker.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=2) == 511
    tracker.allocate(list(range(511)))  # what vLLM allocates for the 511 tokens it takes
    retrieve = planned_retrieve(tracker.plan_step(0))
    assert retrieve.block_ids == tuple(range(511)) and retrieve.skip_trailing_blocks == 1
    assert retrieve.target_block_ids == list(range(511)) + [SKIP_BLOCK]
    assert retrieve.loaded_block_ids == tuple(range(511))
    short = RequestTracker("short", tokens(3, 512), layout, SALT)
    short.record_lookup(num_vllm_hit_tokens=0, num_lmcache_hit_chunks=2)
    short.allocate(list(range(510)))
    with pytest.raises(ValueError, match="511 blocks must be allocated to load our hit, got 510"):
        short.plan_step(0)
