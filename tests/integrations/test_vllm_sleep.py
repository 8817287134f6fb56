"""vLLM's sleep mode through the worker side, with real memfds against a real server:
unregister_kv_caches waits for the transfers in flight and drops every mapping, nothing
can be sent while the cache is freed, and restore_kv_caches registers the cache anew."""

import pytest
import torch

from .test_vllm import (
    BLOCK,
    FullAttentionSpec,
    KVConnectorRole,
    LMCacheMPServerConnector,
    Request,
    SamplingParams,
    blocks_of,
    hand_config,
    kv_cache_config,
    lookup,
    prompt,
    scheduler_output,
    stats,
    step_until_reported,
    worker_connector,
    write_chunks,
)


def fill_random(caches, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for cache in caches:
        raw = cache.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def instance_ids(worker) -> list[int]:
    return [r.instance_id for r in worker._worker.adapter.registrations]


def test_sleep_waits_for_a_store_in_flight_drops_every_mapping_and_wake_registers_anew(
        server):
    config = hand_config(server.url)
    kvcc = kv_cache_config(FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                                             dtype=torch.float16))
    scheduler = LMCacheMPServerConnector(config, KVConnectorRole.SCHEDULER, kvcc)
    worker, caches = worker_connector(config, kvcc, 0)
    assert LMCacheMPServerConnector.supports_sleep_mode(config.kv_transfer_config)
    try:
        fill_random(caches, 41)
        before_sleep = [cache.view(torch.uint8).clone() for cache in caches]
        registrations = stats(server).registrations
        old_ids = instance_ids(worker)
        tokens = prompt(41, 2 * 256)
        source = list(range(32))
        writer = Request("writer", tokens, SamplingParams(max_tokens=1), None)
        assert lookup(scheduler, writer) == (0, False)
        scheduler.update_state_after_alloc(writer, blocks_of(source), 0)
        meta = scheduler.build_connector_meta(scheduler_output(
            new=[(writer, source)], num_scheduled={"writer": len(tokens)}))
        chunks = stats(server).chunks
        worker.bind_connector_metadata(meta)
        worker.wait_for_save()  # the STORE is in flight
        worker.clear_connector_metadata()

        worker.unregister_kv_caches()  # vLLM sleeps: the cache's memory goes next
        after = stats(server)
        assert after.chunks == chunks + 2  # the server read the blocks before they went
        assert after.registrations == registrations - 1
        assert old_ids[0] not in {i.instance_id for i in after.instances}
        worker.unregister_kv_caches()  # idempotent
        for cache in caches:  # what sleep leaves: the memory's old bytes are gone
            cache.zero_()
        worker.bind_connector_metadata(meta)
        with pytest.raises(RuntimeError, match="restore_kv_caches"):
            worker.wait_for_save()  # no stale mapping is ever used
        worker.clear_connector_metadata()

        worker.restore_kv_caches()  # vLLM woke up
        worker.restore_kv_caches()  # idempotent
        assert stats(server).registrations == registrations
        assert instance_ids(worker) != old_ids
        reader = Request("reader", tokens + [7], SamplingParams(max_tokens=1), None)
        assert lookup(scheduler, reader) == (512, True)
        target = list(range(100, 133))
        scheduler.update_state_after_alloc(reader, blocks_of(target), 512)
        meta = scheduler.build_connector_meta(scheduler_output())
        assert step_until_reported([worker], scheduler, meta, 1, "reader") == set()
        for cache, old in zip(caches, before_sleep):
            assert torch.equal(cache.view(torch.uint8)[target[:32]], old[source])

        fill_random(caches, 42)  # a STORE after wake-up reads the new memory
        written = list(range(40, 72))
        new_tokens = prompt(42, 2 * 256)
        write_chunks(scheduler, worker, "after", new_tokens, written)
        expected = [cache.view(torch.uint8)[written].clone() for cache in caches]
        again = Request("again", new_tokens + [7], SamplingParams(max_tokens=1), None)
        assert lookup(scheduler, again) == (512, True)
        scheduler.update_state_after_alloc(again, blocks_of(target), 512)
        meta = scheduler.build_connector_meta(scheduler_output())
        assert step_until_reported([worker], scheduler, meta, 1, "again") == set()
        for cache, want in zip(caches, expected):
            assert torch.equal(cache.view(torch.uint8)[target[:32]], want)
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_sleep_waits_for_a_load_in_flight_and_reports_it_after(server):
    config = hand_config(server.url)
    kvcc = kv_cache_config(FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                                             dtype=torch.float16))
    scheduler = LMCacheMPServerConnector(config, KVConnectorRole.SCHEDULER, kvcc)
    worker, caches = worker_connector(config, kvcc, 0)
    try:
        fill_random(caches, 43)
        tokens = prompt(43, 2 * 256)
        source = list(range(32))
        write_chunks(scheduler, worker, "writer", tokens, source)
        expected = [cache.view(torch.uint8)[source].clone() for cache in caches]
        reader = Request("reader", tokens + [7], SamplingParams(max_tokens=1), None)
        assert lookup(scheduler, reader) == (512, True)
        target = list(range(100, 133))
        scheduler.update_state_after_alloc(reader, blocks_of(target), 512)
        meta = scheduler.build_connector_meta(scheduler_output())
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)  # the RETRIEVE is in flight
        worker.clear_connector_metadata()

        worker.unregister_kv_caches()  # returns once the server writes the blocks no more
        landed = [cache.view(torch.uint8)[target[:32]].clone() for cache in caches]
        assert all(torch.equal(got, want) for got, want in zip(landed, expected))
        worker.restore_kv_caches()
        results = worker.get_transfer_results(set())
        assert results.finished_recving == {"reader"} and not results.failed_recving
        assert worker.get_block_ids_with_load_errors() == set()
    finally:
        worker.shutdown()
        scheduler.shutdown()
