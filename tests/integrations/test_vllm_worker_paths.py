"""The connector's worker side around a server that goes away or restarts, and MLA loads,
driven with vLLM's own data types as in test_vllm.py: no forward pass and no finished
request waits on a server that is gone, the first STORE after a restart lands, and an MLA
follower never takes a late LOAD_DONE for the next load of the same request."""

import threading
import time

import torch

from ..utils import ipc_url, run_server, server_process, started_process, stop_process
from .test_vllm import (
    BLOCK,
    FullAttentionSpec,
    KVConnectorOutput,
    KVConnectorRole,
    LMCacheMPServerConnector,
    MLAAttentionSpec,
    Request,
    RequestStatus,
    SamplingParams,
    blocks_of,
    hand_config,
    kv_cache_config,
    lookup,
    one_rank_connectors,
    prompt,
    scheduler_output,
    step_until_reported,
    worker_connector,
    worker_step,
    write_chunks,
)


def test_with_the_server_gone_preemptions_and_finished_requests_wait_for_nothing():
    """Two requests' stores are in flight when the server stops, then dies: the step that
    handles the preemption of one and the end of the other returns on the lost
    connection, long before the stores' deadline, and reports the finished request."""
    server = server_process(None, ["--cpu-size", "64MiB", "--log-level", "warning"])
    server.start()
    scheduler, worker = one_rank_connectors(server.url, load_timeout=120.0, timeout=2.0)
    try:
        preempted = Request("preempted", prompt(31, 4 * 256), SamplingParams(max_tokens=1), None)
        finished = Request("finished", prompt(32, 2 * 256), SamplingParams(max_tokens=1), None)
        placed = {"preempted": list(range(64)), "finished": list(range(64, 96))}
        for request in (preempted, finished):
            assert lookup(scheduler, request) == (0, False)
            scheduler.update_state_after_alloc(request, blocks_of(placed[request.request_id]), 0)
        meta = scheduler.build_connector_meta(scheduler_output(
            new=[(preempted, placed["preempted"]), (finished, placed["finished"])],
            num_scheduled={"preempted": 4 * 256, "finished": 2 * 256}))
        stop_process(started_process(server).pid)
        worker.bind_connector_metadata(meta)
        worker.wait_for_save()  # the STORE is sent; the stopped server never reads it
        worker.clear_connector_metadata()

        finished.status = RequestStatus.FINISHED_STOPPED
        assert scheduler.request_finished(finished, placed["finished"])[0] is True
        output = scheduler_output(finished={"finished"})
        output.preempted_req_ids = {"preempted"}
        meta = scheduler.build_connector_meta(output)
        assert meta.preempted == ["preempted"] and meta.await_stores == ["finished"]
        killer = threading.Timer(0.2, started_process(server).kill)
        started = time.monotonic()
        killer.start()
        (sending, _, _), = worker_step([worker], meta, finished={"finished"})
        waited = time.monotonic() - started
        killer.join()
        assert waited < 60, waited  # the stores' deadline is 121 s away
        assert "finished" in sending
    finally:
        worker.shutdown()
        scheduler.shutdown()
        server.close()


def test_the_first_store_after_a_server_restart_lands_and_loads_byte_for_byte():
    """The server is killed and another starts at the same endpoint: the next request's
    STORE finds the worker's registration gone, registers again and is sent again."""
    url = ipc_url()
    server = server_process(url, ["--cpu-size", "64MiB", "--log-level", "warning"])
    server.start()
    config = hand_config(url)
    kvcc = kv_cache_config(FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                                             dtype=torch.float16))
    scheduler = LMCacheMPServerConnector(config, KVConnectorRole.SCHEDULER, kvcc)
    worker, caches = worker_connector(config, kvcc, 0)
    generator = torch.Generator().manual_seed(35)
    for cache in caches:
        cache.view(torch.uint8).copy_(torch.randint(0, 256, cache.view(torch.uint8).shape,
                                                    dtype=torch.uint8, generator=generator))
    try:
        write_chunks(scheduler, worker, "before", prompt(33, 2 * 256), list(range(32)))
        started_process(server).kill()
        server.close()
        server = server_process(url, ["--cpu-size", "64MiB", "--log-level", "warning"])
        server.start()
        worker._worker.client.ping()  # connected again (a STORE sent before is skipped)
        tokens = prompt(34, 2 * 256 + 3)
        written = list(range(32, 65))
        write_chunks(scheduler, worker, "after", tokens, written)

        reader = Request("reader", tokens, SamplingParams(max_tokens=1), None)
        assert lookup(scheduler, reader) == (512, True)
        target = list(range(100, 133))
        scheduler.update_state_after_alloc(reader, blocks_of(target), 512)
        meta = scheduler.build_connector_meta(scheduler_output())  # it waits for the load
        assert step_until_reported([worker], scheduler, meta, 1, "reader") == set()
        for cache in caches:
            raw = cache.view(torch.uint8)
            assert torch.equal(raw[target[:32]], raw[written[:32]])
    finally:
        worker.shutdown()
        scheduler.shutdown()
        server.close()


def test_an_mla_followers_late_load_done_is_not_taken_for_the_next_load():
    """MLA TP=2: the follower gives up on a request's load before the leader sends it; the
    request is preempted and loaded again into other blocks: the follower must wait for
    that load, not take the first one's LOAD_DONE, which came late."""
    with run_server() as server:
        mla_load_twice(server.url)


def mla_load_twice(url: str) -> None:
    config = hand_config(url, tp=2, mla=True)
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    kvcc = kv_cache_config(spec)
    scheduler = LMCacheMPServerConnector(config, KVConnectorRole.SCHEDULER, kvcc)
    (leader, follower), caches = zip(*[worker_connector(config, kvcc, rank) for rank in range(2)])
    try:
        generator = torch.Generator().manual_seed(36)
        leader_bytes = [c.view(torch.uint8) for c in caches[0]]
        for raw in leader_bytes:
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
        tokens = prompt(36, 2 * 256 + 30)
        source, first, again = list(range(34)), list(range(40, 74)), list(range(100, 134))
        writer = Request("writer", tokens, SamplingParams(max_tokens=1), None)
        assert lookup(scheduler, writer) == (0, False)
        scheduler.update_state_after_alloc(writer, blocks_of(source), 0)
        worker_step([leader, follower], scheduler.build_connector_meta(scheduler_output(
            new=[(writer, source)], num_scheduled={"writer": len(tokens)})))
        writer.status = RequestStatus.FINISHED_STOPPED
        assert scheduler.request_finished(writer, source) == (True, None)
        step_until_reported([leader, follower], scheduler, scheduler.build_connector_meta(
            scheduler_output(finished={"writer"})), 0, "writer", finished={"writer"})

        reader = Request("reader", tokens, SamplingParams(max_tokens=1), None)
        assert lookup(scheduler, reader) == (512, True)
        scheduler.update_state_after_alloc(reader, blocks_of(first), 512)
        meta = scheduler.build_connector_meta(scheduler_output())
        # it gives up before the leader sends
        follower._worker.adapter.adapters[0].load_timeout = 0.01
        assert step_until_reported([follower], scheduler, meta, 1, "reader")  # recomputed
        assert step_until_reported([leader], scheduler, meta, 1, "reader") == set()
        follower._worker.client.ping()  # the late LOAD_DONE came before this reply
        scheduler.update_connector_output(KVConnectorOutput(finished_recving={"reader"}))

        output = scheduler_output()
        output.preempted_req_ids = {"reader"}
        reader.status = RequestStatus.PREEMPTED
        worker_step([leader, follower], scheduler.build_connector_meta(output))
        reader.status = RequestStatus.WAITING
        assert lookup(scheduler, reader) == (512, True)
        scheduler.update_state_after_alloc(reader, blocks_of(again), 512)
        meta = scheduler.build_connector_meta(scheduler_output())
        assert [load.request_id for load in meta.loads] == ["reader"]
        follower._worker.adapter.adapters[0].load_timeout = 30.0
        ((_, recving, _),) = worker_step([follower], meta)
        assert "reader" not in recving  # the leader has not sent this load yet
        assert step_until_reported([leader], scheduler, meta, 1, "reader") == set()
        assert step_until_reported([follower], scheduler, scheduler.build_connector_meta(
            scheduler_output()), 1, "reader") == set()
        for layer, cache in enumerate(caches[1]):
            assert torch.equal(cache[again[:32]].view(torch.uint8),
                               leader_bytes[layer][source[:32]]), layer
    finally:
        for connector in (leader, follower, scheduler):
            connector.shutdown()
