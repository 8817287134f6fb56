"""The worker adapter's transfers end when the server can no longer touch their blocks:
loads are tagged, a gone server ends every wait at once, and a restart loses no STORE."""

import secrets
import threading
import time

import torch

from lmcache_mp.client import (
    CacheClient,
    LookupItem,
    ParallelStrategy,
    TransferItem,
    WorkerAdapter,
)

from ..utils import ipc_url, run_server, server_process, started_process, stop_process
from ..workers import MLA, MODEL, chunk_blocks, expected_blocks, make_cache, prompt

NUM_BLOCKS = 8 * 16
ALONE = ParallelStrategy(False, 1, 0, 1)


def until(condition, what: str, timeout: float = 30.0):
    """Poll `condition` until it returns something true; that value."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.005)
    return value


def finished(adapter: WorkerAdapter, kind: int, request_id: str) -> set[int]:
    """Wait until the adapter reports the request's store (kind 0) or load (kind 1); its
    load errors since the last call."""
    until(lambda: request_id in adapter.get_finished()[kind], f"{request_id} reported")
    return adapter.get_block_ids_with_load_errors()


def test_a_late_load_done_is_not_taken_for_the_next_load_of_the_request():
    """A follower gave up on load 1 before the leader sent it; its LOAD_DONE, late, must
    not make the follower report load 2 of the same request before its blocks are written."""
    with run_server() as server:
        engine = secrets.token_hex(16)
        hashes = prompt(300, 2)
        source, first, second = chunk_blocks([0, 1]), chunk_blocks([2, 3]), chunk_blocks([5, 6])
        with make_cache(NUM_BLOCKS, 31, MLA) as leader_cache, \
                make_cache(NUM_BLOCKS, None, MLA) as follower_cache, \
                CacheClient(server.url, timeout=30, engine=engine) as leader_client, \
                CacheClient(server.url, timeout=30, engine=engine,
                            mla_follower=True) as follower_client:
            leader = WorkerAdapter(leader_client, MODEL, ParallelStrategy(True, 2, 0, 2),
                                   load_timeout=30, tp_group="g")
            follower = WorkerAdapter(follower_client, MODEL, ParallelStrategy(True, 2, 1, 2),
                                     load_timeout=0.01, tp_group="g")
            leader.register_kv_cache(leader_cache)
            follower.register_kv_cache(follower_cache)
            leader.start_store([TransferItem.build("w", hashes, source)])
            finished(leader, 0, "w")

            follower.start_load([TransferItem.build("r", hashes, first)])
            assert finished(follower, 1, "r") == set(first)  # gave up: recomputed
            leader.start_load([TransferItem.build("r", hashes, first)])
            assert finished(leader, 1, "r") == set()
            follower_client.ping()  # the late LOAD_DONE came before this reply

            follower.load_timeout = 30
            follower.start_load([TransferItem.build("r", hashes, second)])
            assert "r" not in follower.get_finished()[1]  # the leader has not sent load 2
            leader.start_load([TransferItem.build("r", hashes, second)])
            assert finished(leader, 1, "r") == set()
            assert finished(follower, 1, "r") == set()
            assert torch.equal(follower_cache.blocks(second).view(torch.uint8),
                               expected_blocks(NUM_BLOCKS, 31, source, MLA))


def test_waiting_for_a_store_ends_at_once_when_the_server_dies():
    """The server stops before it reads a STORE, then dies: the wait ends on the lost
    connection, long before the store's deadline (a dead server reads no blocks)."""
    server = server_process(None, ["--cpu-size", "64MiB", "--log-level", "warning"])
    server.start()
    try:
        with make_cache(NUM_BLOCKS, 5) as cache, server.client(timeout=30) as client:
            adapter = WorkerAdapter(client, MODEL, ALONE, load_timeout=120)
            adapter.register_kv_cache(cache)
            stop_process(started_process(server).pid)
            adapter.start_store([TransferItem.build("r", prompt(301, 2), chunk_blocks([0, 1]))])
            killer = threading.Timer(0.2, started_process(server).kill)
            started = time.monotonic()
            killer.start()
            adapter.wait_for_stores(["r"])
            waited = time.monotonic() - started
            killer.join()
            assert waited < 60, waited  # its deadline is 121 s away
            assert adapter.get_finished()[0] == {"r"}
    finally:
        server.close()


def test_with_the_server_down_transfers_finish_at_once_and_loads_are_recomputed():
    url = ipc_url()
    with make_cache(NUM_BLOCKS, 6) as cache, CacheClient(url, timeout=30) as client:
        adapter = WorkerAdapter(client, MODEL, ALONE, load_timeout=120)
        with run_server(url=url):
            adapter.register_kv_cache(cache)
        hashes = prompt(302, 2)
        started = time.monotonic()
        adapter.start_store([TransferItem.build("s", hashes, chunk_blocks([0, 1]))])
        adapter.start_load([TransferItem.build("l", hashes, chunk_blocks([2, 3]))])
        adapter.wait_for_stores(["s"])
        assert adapter.get_finished() == ({"s"}, {"l"})
        assert adapter.get_block_ids_with_load_errors() == set(chunk_blocks([2, 3]))
        assert time.monotonic() - started < 60  # their deadlines are 121 s away


def test_the_first_store_after_a_server_restart_is_sent_again_and_lands():
    """The server is killed and another starts at the same endpoint between two STOREs:
    the second finds its registration gone, registers again and is sent again."""
    url = ipc_url()
    first, second = prompt(303, 2), prompt(304, 3)
    source = chunk_blocks([2, 3, 4])
    with make_cache(NUM_BLOCKS, 7) as cache, CacheClient(url, timeout=30) as client:
        adapter = WorkerAdapter(client, MODEL, ALONE, load_timeout=30)
        server = server_process(url, ["--cpu-size", "64MiB", "--log-level", "warning"])
        server.start()
        try:
            adapter.register_kv_cache(cache)
            assert adapter.registration is not None
            stale_id = adapter.registration.instance_id
            adapter.start_store([TransferItem.build("a", first, chunk_blocks([0, 1]))])
            finished(adapter, 0, "a")
            started_process(server).kill()
            server.close()
            server = server_process(url, ["--cpu-size", "64MiB", "--log-level", "warning"])
            server.start()
            client.ping()  # connected to the new server (a STORE sent before would be skipped)
            adapter.start_store([TransferItem.build("b", second, source)])
            finished(adapter, 0, "b")
            assert adapter.registration is not None
            assert adapter.registration.instance_id != stale_id
            assert client.lookup(MODEL, 1, [LookupItem.build("b", second)]) == [3]
            with make_cache(NUM_BLOCKS, None) as target_cache, \
                    CacheClient(url, timeout=30) as reader:
                registration = reader.register_kv_cache(
                    target_cache.handles(), model=MODEL, layout="mha", block_size=16)
                target = chunk_blocks([7, 6, 5])
                assert reader.retrieve(registration,
                                       [TransferItem.build("c", second, target)]) == [3]
                assert torch.equal(target_cache.blocks(target).view(torch.uint8),
                                   expected_blocks(NUM_BLOCKS, 7, source))
                reader.unregister(registration)
        finally:
            server.close()


def test_the_blocks_of_a_load_never_change_once_the_adapter_reports_it():
    """A load with a budget too short for the server (its one copy thread is busy with a
    large STORE) is reported failed; its blocks do not change after that report."""
    chunks = 48
    num_blocks = 64 * 16
    blocks = chunk_blocks(list(range(chunks)))
    stored, busy = prompt(305, chunks), prompt(306, chunks)
    with run_server("--cpu-size", "192MiB", "--copy-threads", "1") as server, \
            make_cache(num_blocks, 8) as source, make_cache(num_blocks, None) as target, \
            CacheClient(server.url, timeout=30) as client:
        writer = WorkerAdapter(client, MODEL, ALONE, load_timeout=60)
        reader = WorkerAdapter(client, MODEL, ALONE, load_timeout=0.001)
        writer.register_kv_cache(source)
        reader.register_kv_cache(target)
        writer.start_store([TransferItem.build("s", stored, blocks)])
        finished(writer, 0, "s")

        writer.start_store([TransferItem.build("busy", busy, blocks)])
        reader.start_load([TransferItem.build("r", stored, blocks)])
        failed = finished(reader, 1, "r")
        reported = target.blocks(blocks).view(torch.uint8).clone()
        finished(writer, 0, "busy")
        assert failed  # recomputed: the copies did not start within the budget
        assert torch.equal(target.blocks(blocks).view(torch.uint8), reported)
        landed = [b for b in blocks if b not in failed]
        assert not landed or torch.equal(target.blocks(landed).view(torch.uint8),
                                         expected_blocks(num_blocks, 8, landed))
