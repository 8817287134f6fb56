"""A hybrid model with recurrent state (a Mamba group beside full attention, vLLM's
mamba_cache_mode "align") under vLLM's real scheduler, with vLLM's own plan of the groups
(one pool of blocks, the groups in the same tensors). The state vLLM keeps at a chunk's end
is stored with the chunk; a second engine's hit restores the attention KV and the state at
the hit point byte for byte, and its forward pass starts from that state."""

import pytest
import torch

from lmcache_mp.protocol import SKIP_BLOCK, unpack_block_ids
from lmcache_mp.server.cache.pool import aligned

from .test_vllm import (  # vLLM's names too: test_vllm imports them for the CPU
    BLOCK,
    FullAttentionSpec,
    KVCacheBlock,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVConnectorRole,
    LMCacheMPServerConnector,
    MambaSpec,
    NewRequestData,
    Request,
    RequestStatus,
    SamplingParams,
    SchedulerConfig,
    hand_config,
    layer_name,
    lookup,
    planned_kv_cache_config,
    prompt,
    scheduler_output,
    stats,
    step_until_reported,
    wait_for_leases,
    worker_connector,
    worker_step,
)

CHUNK = 256
ATTENTION = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                              dtype=torch.float16)
# conv and SSM state of 4480 bytes, its page padded to the attention's, as vLLM pads it
STATE_BYTES = 3 * 64 * 2 + 2 * 64 * 16 * 2


def mamba(**overrides) -> MambaSpec:
    fields = dict(block_size=BLOCK, shapes=((3, 64), (2, 64, 16)),
                  dtypes=(torch.float16, torch.float16),
                  page_size_padded=ATTENTION.page_size_bytes, mamba_cache_mode="align")
    return MambaSpec(**{**fields, **overrides})


# a 4-layer model whose odd layers are Mamba layers (as vLLM groups a Mamba2 hybrid)
GROUPS = [(ATTENTION, [0, 2]), (mamba(), [1, 3])]
# steps of at most a chunk: every chunk boundary of a prompt is the end of a step, where
# vLLM's align mode keeps a state
CHUNKED = dict(kv_groups=GROUPS, mamba_cache_mode="align", max_num_batched_tokens=CHUNK)
# vLLM's own default step (SchedulerConfig's max_num_batched_tokens): a long prompt in
# steps of 8 chunks, a state kept only where one ends on a chunk boundary
DEFAULT_STEP = SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS
LONG = dict(kv_groups=GROUPS, mamba_cache_mode="align", max_num_batched_tokens=DEFAULT_STEP,
            num_blocks=400)


def written(item) -> list[int]:
    return [b for b in unpack_block_ids(item.block_ids, "block_ids") if b != SKIP_BLOCK]


def the_load(engine):
    (load,) = [load for meta in engine.metas for load in meta.loads if load.items]
    return load


def assert_resumed_from(engine, name: str, tokens: list[int], position: int) -> None:
    """The request's first pass computed from `position` on, starting from the loaded state
    of exactly the tokens before it, and its attention KV holds `tokens`, byte for byte."""
    assert engine.first_computed[name] == position
    assert engine.state_reads[name][0] == (position, True)
    engine.assert_kv(name, tokens)


@pytest.mark.parametrize("state_first", [False, True], ids=["attention-first", "state-first"])
def test_a_second_engine_restores_the_state_and_the_kv_at_the_hit_point(engines, server,
                                                                        state_first):
    """In either group order (vLLM puts a Qwen3-Next's recurrent group first)."""
    salt = f"state-1-{state_first}"
    tokens = prompt(81 + state_first, 3 * CHUNK + 40)
    groups = GROUPS[::-1] if state_first else GROUPS
    order = slice(None, None, -1 if state_first else 1)  # (attention, state) in vLLM's order
    writer = engines(kv_groups=groups, mamba_cache_mode="align", max_num_batched_tokens=CHUNK)
    writer.add("write", tokens, salt)
    writer.run_until_idle()
    tenant = stats(server).tenants[salt]
    assert tenant.chunks == 3 * 2  # each chunk once per group: its KV, its end's state
    # a state chunk is the state of the group's 2 layers, once, whatever the chunk's tokens
    # (the pool places chunks in extents of 4 KiB)
    attention_chunk = 2 * 2 * CHUNK * 2 * 64 * 2
    assert tenant.bytes_used == 3 * (attention_chunk + aligned(2 * STATE_BYTES))
    models = {i.model for i in stats(server).instances}
    named = ",".join(["full:2", f"state{STATE_BYTES}:2"][order])
    assert any(m.endswith(f"-groups[{named}]") for m in models), models

    reader = engines(kv_groups=groups, mamba_cache_mode="align", max_num_batched_tokens=CHUNK)
    reader.add("read", tokens, salt)
    reader.run_until_idle()
    assert reader.first_computed["read"] == 3 * CHUNK  # the 3 chunks loaded (async)
    # the first pass started from the loaded state, that of exactly the first 768 tokens
    assert reader.state_reads["read"][0] == (3 * CHUNK, True)
    reader.assert_kv("read", tokens)  # the attention KV, byte for byte
    full_item, state_item = the_load(reader).items[order]
    full_table, state_table = reader.group_tables["read"][order]
    assert written(full_item) == full_table[:48]
    assert written(state_item) == [state_table[47]]  # the state at the hit point alone
    assert stats(server).leases_held == 0


def test_a_hit_deeper_than_vllms_own_loads_the_kv_from_there_and_the_state_at_its_end(
        engines, server):
    """The reader's own prefix cache holds the attention KV of 288 tokens, and lost the
    state there (evicted under block pressure, as vLLM evicts it): the groups' local hits
    diverge, and vLLM offers the full-attention one (supports_divergent_local_hybrid_hits);
    ours adds the KV of [288, 768) and the state at 768."""
    salt = "state-2"
    tokens = prompt(82, 3 * CHUNK + 40)
    reader = engines(kv_groups=GROUPS, mamba_cache_mode="align")  # steps of up to 512
    reader.add("own", tokens[:CHUNK + 40], salt)  # steps of 288 and 8 tokens
    reader.run_until_idle()
    assert stats(server).tenants[salt].chunks == 1  # chunk 0's KV, and no state at 256
    own_state = reader.group_tables["own"][1][17]  # the state after 288 tokens
    reader.scheduler.kv_cache_manager.block_pool.evict_blocks({own_state})
    writer = engines(**CHUNKED)
    writer.add("write", tokens, salt)
    writer.run_until_idle()

    reader.add("read", tokens, salt)
    reader.run_until_idle()
    assert_resumed_from(reader, "read", tokens, 3 * CHUNK)
    full_item, state_item = the_load(reader).items
    full_table, state_table = reader.group_tables["read"]
    assert written(full_item) == full_table[18:48]  # vLLM's own 18 blocks stay as they are
    assert written(state_item) == [state_table[47]]
    assert stats(server).leases_held == 0


def test_a_hit_ends_at_the_last_chunk_stored_with_its_state(engines, server):
    """A chunk's state is stored only where vLLM kept it (a step ended there): an engine
    that computes the last chunk and the prompt's tail in one step stores that chunk's
    attention KV alone, and a hit ends before it."""
    salt = "state-3"
    tokens = prompt(83, 3 * CHUNK + 40)
    first = engines(**CHUNKED)
    first.add("two", tokens[:2 * CHUNK + 40], salt)
    first.run_until_idle()
    assert stats(server).tenants[salt].chunks == 2 * 2

    second = engines(kv_groups=GROUPS, mamba_cache_mode="align")  # one step of 296 tokens
    second.add("three", tokens, salt)
    second.run_until_idle()
    assert second.first_computed["three"] == 2 * CHUNK  # loaded 2 chunks, computed the rest
    assert second.state_reads["three"][0] == (2 * CHUNK, True)
    assert stats(server).tenants[salt].chunks == 2 * 2 + 1  # chunk 2's KV, no state at 768

    reader = engines(**CHUNKED)
    reader.add("read", tokens, salt)
    reader.run_until_idle()
    assert_resumed_from(reader, "read", tokens, 2 * CHUNK)
    assert stats(server).leases_held == 0


def test_a_hit_of_a_whole_prompt_ends_a_chunk_short(engines, server):
    """vLLM computes at least a prompt's last token, from the state before it: a prompt of
    whole chunks is loaded up to its last chunk boundary but one, whose state it has."""
    salt = "state-4"
    tokens = prompt(84, 2 * CHUNK)
    writer = engines(**CHUNKED)
    writer.add("write", tokens, salt)
    writer.run_until_idle()
    assert stats(server).tenants[salt].chunks == 2 * 2
    reader = engines(**CHUNKED)
    reader.add("read", tokens, salt)
    reader.run_until_idle()
    assert_resumed_from(reader, "read", tokens, CHUNK)
    assert stats(server).leases_held == 0


def test_an_abort_during_the_state_load_leaves_no_hold(engines, server):
    salt = "state-5"
    tokens = prompt(85, 3 * CHUNK + 40)
    writer = engines(**CHUNKED)
    writer.add("write", tokens, salt)
    writer.run_until_idle()
    reader = engines(**CHUNKED)
    reader.add("read", tokens, salt)
    while not any(meta.loads for meta in reader.metas):
        reader.step()
    reader.scheduler.finish_requests("read", RequestStatus.FINISHED_ABORTED)
    reader.run_until_idle()
    assert stats(server).leases_held == 0
    free = reader.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert free == reader.num_blocks - 1


def test_preempted_requests_restore_their_state_and_leave_no_hold(engines, server):
    """Two requests that outgrow a small pool: vLLM preempts one, which looks up again
    when it resumes; both end, and nothing stays held."""
    salt = "state-6"
    a, b = prompt(86, 2 * CHUNK + 40), prompt(87, 2 * CHUNK + 40)
    writer = engines(**CHUNKED)
    writer.add("a", a, salt)
    writer.add("b", b, salt)
    writer.run_until_idle()
    reader = engines(num_blocks=72, **CHUNKED)
    reader.add("a", a, salt, max_tokens=120)
    reader.add("b", b, salt, max_tokens=120)
    reader.run_until_idle()
    # every pass of either request started from the state of exactly its tokens before
    assert all(ok for reads in reader.state_reads.values() for _, ok in reads)
    assert any(status is RequestStatus.PREEMPTED
               for statuses in reader.statuses.values() for status in statuses)
    assert stats(server).leases_held == 0


@pytest.mark.parametrize(("spec", "case"), [
    (mamba(mamba_cache_mode="none"), r"mamba_cache_mode is 'none', not \"align\""),
    (mamba(num_speculative_blocks=1), r"num_speculative_blocks is 1"),
])
def test_a_state_vllm_cannot_restore_at_a_boundary_is_refused_naming_the_case(server, spec, case):
    kvcc = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([layer_name(0), layer_name(2)], ATTENTION),
        KVCacheGroupSpec([layer_name(1), layer_name(3)], spec)])
    with pytest.raises(ValueError, match=r"recurrent state of vLLM's KV cache group 1 "
                                         r"\(MambaSpec: layers model\.layers\.1\.self_attn"
                                         r"\.attn, model\.layers\.3\.self_attn\.attn\): " + case):
        LMCacheMPServerConnector(hand_config(server.url), KVConnectorRole.SCHEDULER, kvcc)


def test_a_model_of_recurrent_state_alone_is_refused(server):
    kvcc = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([layer_name(0), layer_name(1)], mamba())])
    with pytest.raises(ValueError, match="recurrent state of a model without attention layers"):
        LMCacheMPServerConnector(hand_config(server.url), KVConnectorRole.SCHEDULER, kvcc)


def test_hits_finer_than_a_recurrent_block_are_refused(server):
    kvcc = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([layer_name(0)], ATTENTION),
        KVCacheGroupSpec([layer_name(1)], mamba(num_prefill_checkpoint_blocks=1,
                                                 prefill_checkpoint_alignment=1))],
        cache_hit_alignment_tokens=8)
    with pytest.raises(ValueError, match="prefix-cache hits land every 8 tokens, within its "
                                         "blocks of 16"):
        LMCacheMPServerConnector(hand_config(server.url), KVConnectorRole.SCHEDULER, kvcc)


def test_a_prefill_checkpoint_at_a_chunk_boundary_is_stored_and_restored(engines, server):
    """Mamba2 layers export the state at the prompt's last block boundary from within the
    pass (vLLM's prefill checkpoint blocks): a prompt of 260 tokens is one step, whose
    checkpoint at 256 is chunk 0's state."""
    checkpointed = [(ATTENTION, [0, 2]), (mamba(num_prefill_checkpoint_blocks=1,
                                                prefill_checkpoint_alignment=1), [1, 3])]
    salt = "state-8"
    tokens = prompt(92, CHUNK + 4)
    writer = engines(kv_groups=checkpointed, mamba_cache_mode="align")
    writer.add("write", tokens, salt)
    writer.run_until_idle()
    assert writer.state_reads["write"][0] == (CHUNK + 4, True)  # the prompt in one step
    assert stats(server).tenants[salt].chunks == 1 * 2

    reader = engines(kv_groups=checkpointed, mamba_cache_mode="align")
    reader.add("read", [*tokens, *prompt(93, 30)], salt)
    reader.run_until_idle()
    assert reader.first_computed["read"] == CHUNK
    assert reader.state_reads["read"][0] == (CHUNK, True)
    assert stats(server).leases_held == 0


def test_mla_beside_a_state_and_a_state_block_that_does_not_divide_the_chunk_are_refused(
        server):
    for mla, spec, case in ((True, mamba(), "the model uses MLA beside it"),
                            (False, mamba(block_size=96), "its block size 96 does not divide "
                                                          "lmcache-mp's chunk_size 256")):
        kvcc = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([layer_name(0)], ATTENTION),
            KVCacheGroupSpec([layer_name(1)], spec)])
        with pytest.raises(ValueError, match=case):
            LMCacheMPServerConnector(hand_config(server.url, mla=mla),
                                     KVConnectorRole.SCHEDULER, kvcc)


def test_the_state_at_a_chunk_the_answer_completes_is_stored_and_restored(engines, server):
    """Turn 1: 356 prompt tokens and a 200-token answer: decoding keeps the state at each
    block boundary, so the chunk the answer completes (tokens 256-511) is stored with the
    state after token 511; turn 2 on a fresh engine starts from it."""
    salt = "state-7"
    first_prompt = prompt(88, CHUNK + 100)
    first = engines(**CHUNKED)
    turn1 = first.add("turn-1", first_prompt, salt, max_tokens=200)
    first.run_until_idle()
    assert stats(server).tenants[salt].chunks == 2 * 2

    second_prompt = [*first_prompt, *turn1.output_token_ids, *prompt(89, 50)]
    second = engines(**CHUNKED)
    second.add("turn-2", second_prompt, salt)
    second.run_until_idle()
    assert_resumed_from(second, "turn-2", second_prompt, 2 * CHUNK)
    assert stats(server).leases_held == 0


def test_a_state_block_vllm_gives_out_again_waits_for_the_store_that_reads_it(server):
    """vLLM frees a request's older state blocks while it runs; when another request gets
    one in a step after the STORE that reads it, the workers wait for that STORE."""
    config = hand_config(server.url)
    config.cache_config.mamba_cache_mode = "align"
    kvcc = planned_kv_cache_config(config, GROUPS, 160)
    scheduler = LMCacheMPServerConnector(config, KVConnectorRole.SCHEDULER, kvcc)
    try:
        first = Request("first", prompt(90, CHUNK + 16), SamplingParams(max_tokens=2), None)
        full, state = list(range(1, 18)), [0] * 15 + [18, 19]
        assert lookup(scheduler, first) == (0, False)
        scheduler.update_state_after_alloc(
            first, KVCacheBlocks(tuple([KVCacheBlock(i) for i in ids] for ids in (full, state))),
            0)
        output = scheduler_output(num_scheduled={"first": CHUNK + 16})
        output.scheduled_new_reqs = [NewRequestData.from_request(first, (full, state))]
        meta = scheduler.build_connector_meta(output)
        (store,) = meta.stores
        ((full_item,), (state_item,)) = store.groups
        assert unpack_block_ids(full_item.block_ids, "block_ids") == full[:16]
        assert unpack_block_ids(state_item.block_ids, "block_ids") == [18]  # the state at 256
        assert state_item.parent_hash == b""  # a root
        assert not meta.fence

        second = Request("second", prompt(91, 40), SamplingParams(max_tokens=2), None)
        output = scheduler_output(num_scheduled={"second": 40})
        output.scheduled_new_reqs = [NewRequestData.from_request(second, ([40, 41], [0, 18]))]
        assert scheduler.build_connector_meta(output).fence == ["first"]
        first.status = RequestStatus.FINISHED_ABORTED
        scheduler.request_finished_all_groups(first, (full, state))
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_long_prefill_in_default_steps_stores_its_kv_and_the_state_where_a_step_ended(
        engines, server, tp):
    """vLLM's default steps of 2048 tokens: a prompt of 2348 tokens is computed in a step
    that ends at chunk boundary 2048 and one of 300 tokens. Every chunk's attention KV is
    stored, the state only at 2048, and a second engine's hit ends there, the deepest
    boundary with a state, restoring it and the KV before it (with TP 2, each rank's)."""
    salt = f"state-9-tp{tp}"
    tokens = prompt(94, DEFAULT_STEP + 300)
    writer = engines(tp=tp, **LONG)
    writer.add("write", tokens, salt)
    writer.run_until_idle()
    # the prompt in two steps, 2048 and 300 tokens: the second starts from the state at 2048
    assert writer.state_reads["write"][0] == (DEFAULT_STEP, True)
    full_chunks = len(tokens) // CHUNK
    # 9 chunks' KV and 1 state, per rank
    assert stats(server).tenants[salt].chunks == (full_chunks + 1) * tp

    reader = engines(tp=tp, **LONG)
    reader.add("read", tokens, salt)
    reader.run_until_idle()
    assert_resumed_from(reader, "read", tokens, DEFAULT_STEP)
    full_item, state_item = the_load(reader).items
    full_table, state_table = reader.group_tables["read"]
    last = DEFAULT_STEP // BLOCK - 1
    assert written(full_item) == full_table[:last + 1]
    assert written(state_item) == [state_table[last]]  # the state at 2048 alone
    assert stats(server).leases_held == 0


def test_a_checkpoint_at_the_end_of_a_one_step_prompt_is_the_hit_point(engines, server):
    """A prompt of 4 chunks and 4 tokens in one step, with Mamba2's prefill checkpoint at
    its last block boundary, 1024: the 4 chunks' KV and the state at 1024 are stored, and
    a second engine loads all 4 chunks."""
    checkpointed = [(ATTENTION, [0, 2]), (mamba(num_prefill_checkpoint_blocks=1,
                                                prefill_checkpoint_alignment=1), [1, 3])]
    salt = "state-10"
    tokens = prompt(95, 4 * CHUNK + 4)
    writer = engines(kv_groups=checkpointed, mamba_cache_mode="align",
                     max_num_batched_tokens=DEFAULT_STEP)
    writer.add("write", tokens, salt)
    writer.run_until_idle()
    assert writer.state_reads["write"][0] == (len(tokens), True)  # the prompt in one step
    assert stats(server).tenants[salt].chunks == 4 + 1

    longer = [*tokens, *prompt(96, 30)]
    reader = engines(kv_groups=checkpointed, mamba_cache_mode="align",
                     max_num_batched_tokens=DEFAULT_STEP)
    reader.add("read", longer, salt)
    reader.run_until_idle()
    assert_resumed_from(reader, "read", longer, 4 * CHUNK)
    assert stats(server).leases_held == 0


def test_a_state_evicted_at_the_last_boundary_ends_the_hit_at_one_that_has_a_state(
        engines, server):
    """The long prefill above stores the state at 2048 alone; a chunked engine then stores
    the states at 256 and 512 of the same prompt's start (its KV is there already), under
    a quota with no room for the second: the salt's least recent chunk that no stored
    chunk follows goes, the state at 2048 (a state is the root of nothing). A hit then
    ends at 512, the deepest boundary with a state."""
    salt = "state-11"
    tokens = prompt(97, DEFAULT_STEP + 300)
    writer = engines(**LONG)
    writer.add("write", tokens, salt)
    writer.run_until_idle()
    assert stats(server).tenants[salt].chunks == len(tokens) // CHUNK + 1
    with server.client(admin=True) as admin:
        admin.quota_set(salt, stats(server).tenants[salt].bytes_used
                        + 2 * aligned(2 * STATE_BYTES) - 1)
    start = engines(**CHUNKED)
    start.add("start", tokens[:2 * CHUNK + 40], salt)
    start.run_until_idle()
    tenant = stats(server).tenants[salt]
    assert tenant.chunks == len(tokens) // CHUNK + 2 and tenant.evictions == 1

    reader = engines(**LONG)
    reader.add("read", tokens, salt)
    reader.run_until_idle()
    assert_resumed_from(reader, "read", tokens, 2 * CHUNK)
    assert stats(server).leases_held == 0


def test_a_load_whose_state_has_no_block_fails_and_releases_its_hold(server):
    """Where vLLM allocated no block for the state at the hit point, the attention KV alone
    is not loaded: the load goes out with no item, the request's load fails
    (failed_recving: vLLM recomputes it) and the LOOKUP's hold is released."""
    config = hand_config(server.url)
    kvcc = planned_kv_cache_config(config, GROUPS, 160)
    scheduler = LMCacheMPServerConnector(config, KVConnectorRole.SCHEDULER, kvcc)
    worker, _ = worker_connector(config, kvcc, 0)
    tokens = prompt(95, CHUNK + 16)

    try:
        tables = (list(range(1, 18)), [0] * 15 + [18, 19])
        write = Request("w", tokens, SamplingParams(max_tokens=1), None)
        assert lookup(scheduler, write) == (0, False)
        scheduler.update_state_after_alloc(write, KVCacheBlocks(tuple(
            [KVCacheBlock(i) for i in ids] for ids in tables)), 0)
        output = scheduler_output(num_scheduled={"w": CHUNK + 16})
        output.scheduled_new_reqs = [NewRequestData.from_request(write, tables)]
        worker_step([worker], scheduler.build_connector_meta(output))
        write.status = RequestStatus.FINISHED_STOPPED
        assert scheduler.request_finished_all_groups(write, tables)[0] is True
        step_until_reported([worker], scheduler, scheduler.build_connector_meta(
            scheduler_output(finished={"w"})), 0, "w", finished={"w"})
        assert stats(server).tenants[""].chunks == 2

        read = Request("r", tokens, SamplingParams(max_tokens=1), None)
        assert lookup(scheduler, read) == (CHUNK, True)
        wait_for_leases(server, 1)
        scheduler.update_state_after_alloc(read, KVCacheBlocks(tuple(
            [KVCacheBlock(i) for i in ids] for ids in (list(range(20, 36)), [0] * 16))), CHUNK)
        meta = scheduler.build_connector_meta(scheduler_output())
        (load,) = meta.loads
        assert load.items == () and load.failed_block_ids == tuple(range(20, 36))
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(set())
        worker.clear_connector_metadata()
        assert results.finished_recving == {"r"} and results.failed_recving == {"r"}
        wait_for_leases(server, 0)
        read.status = RequestStatus.FINISHED_ABORTED
        scheduler.request_finished_all_groups(read, ([], []))
    finally:
        worker.shutdown()
        scheduler.shutdown()
