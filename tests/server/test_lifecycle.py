"""Eviction, leases, dead clients and shutdown, against a real server process."""

import os
import re
import signal
import socket
import time

import pytest
import torch

from lmcache_mp.client import CacheClient, LeaseRef, LookupItem, StoreStatus, TransferItem
from lmcache_mp.errors import RequestTimeout
from lmcache_mp.protocol import StoreReply, StoreRequest
from lmcache_mp.server.cache.pool import CpuPool
from lmcache_mp.spawn import ForkedServer

from ..utils import (
    ipc_url,
    run_server,
    server_process,
    shm_segments,
    started_process,
    wait_for,
)
from ..workers import (
    BLOCKS_PER_CHUNK,
    MODEL,
    Job,
    WorkerProcess,
    abandoned_store_worker,
    chunk_blocks,
    context,
    expected_blocks,
    make_cache,
    prompt,
    retrieve_worker,
    run,
)

CHUNK_BYTES = 512 * 1024  # W2
W1 = dict(layout="mha", num_layers=32, block_size=16, heads=8, head_dim=128, dtype=torch.float16)
W1_CHUNK_BYTES = 32 * 1024**2


@pytest.fixture
def registered(request):
    """A W2 cache of 8 chunks with random bytes, registered with the given server's client."""
    def make(client, seed=1):
        cache = make_cache(8 * BLOCKS_PER_CHUNK, seed)
        registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                 block_size=16)
        request.addfinalizer(cache.close)
        return cache, registration
    return make


def test_a_full_pool_evicts_least_recent_and_a_requests_later_chunks_first(registered):
    with run_server("--cpu-size", "2MiB") as server, CacheClient(server.url) as client:
        _, registration = registered(client)
        first, second = prompt(60, 4), prompt(61, 2)
        assert client.store(registration, [TransferItem.build("a", first, chunk_blocks(range(4)))]
                            ) == [bytes([StoreStatus.STORED] * 4)]
        assert client.store(registration, [TransferItem.build("b", second, chunk_blocks([4, 5]))]
                            ) == [bytes([StoreStatus.STORED] * 2)]
        assert client.lookup(MODEL, 1, [LookupItem.build("a", first),
                                        LookupItem.build("b", second)]) == [2, 2]
        stats = client.stats()
        assert stats.evictions == 2
        assert stats.chunks == 4
        assert stats.bytes_used == 4 * CHUNK_BYTES <= stats.capacity_bytes


def test_held_chunks_survive_pressure_until_their_lease_expires(registered):
    with run_server("--cpu-size", "1MiB", "--lease-timeout", "1") as server, \
            CacheClient(server.url) as client:
        _, registration = registered(client)
        held, newcomer = prompt(70, 2), prompt(71, 1)
        client.store(registration, [TransferItem.build("a", held, chunk_blocks([0, 1]))])
        assert client.lookup(MODEL, 1, [LookupItem.build("reader", held, hold=True)]) == [2]
        assert client.stats().leases_held == 1
        store_newcomer = [TransferItem.build("n", newcomer, chunk_blocks([2]))]
        assert client.store(registration, store_newcomer) == [bytes([StoreStatus.NO_SPACE])]
        wait_for(lambda: client.stats().leases_held == 0, "the lease expired")
        assert client.store(registration, store_newcomer) == [bytes([StoreStatus.STORED])]


def test_retrieve_release_and_end_session_drop_holds(registered):
    with run_server() as server, CacheClient(server.url) as client:
        _, registration = registered(client)
        hashes = prompt(80, 2)
        client.store(registration, [TransferItem.build("w", hashes, chunk_blocks([0, 1]), "salt")])
        for request_id in ("r1", "r2", "r3"):
            client.lookup(MODEL, 1, [LookupItem.build(request_id, hashes, "salt", hold=True)])
        assert client.stats().leases_held == 3
        assert client.retrieve(registration, [TransferItem.build(
            "r1", hashes, chunk_blocks([6, 7]), "salt")]) == [2]
        assert client.release([LeaseRef("r2", "other-salt")]) == 0
        assert client.release([LeaseRef("r2", "salt")]) == 2
        assert client.end_session("r3", "salt") == 2
        assert client.stats().leases_held == 0


def mapped_by(pid: int, segment: str) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return segment in maps.read()


def test_a_client_killed_mid_store_leaves_no_partial_chunk_and_no_leak():
    with run_server("--cpu-size", "512MiB", "--worker-timeout", "1.5") as server, \
            CacheClient(server.url) as client:
        hashes = prompt(90, 8)
        job = Job(server.url, 8 * BLOCKS_PER_CHUNK, 21, hashes, chunk_blocks(range(8)), shape=W1)
        with WorkerProcess(abandoned_store_worker, job) as worker:
            segment = worker.receive()
            worker.process.kill()
            worker.process.join()
        try:
            # The registration goes the moment the worker hangs up (its watch); its mapping
            # and the STORE's pending chunks once the copies already running are done.
            wait_for(lambda: client.stats().registrations == 0, "no registration")
            wait_for(lambda: client.stats().pending_stores == 0, "no pending store")
            pid = started_process(server).pid
            wait_for(lambda: not mapped_by(pid, segment), "the segment unmapped")
            stats = client.stats()
            (visible,) = client.lookup(MODEL, 1, [LookupItem.build("check", hashes)])
            assert stats.chunks == visible
            assert stats.bytes_used == visible * W1_CHUNK_BYTES
            assert not mapped_by(started_process(server).pid, segment)
        finally:
            if os.path.exists(f"/dev/shm/{segment}"):
                os.unlink(f"/dev/shm/{segment}")  # the killed worker could not unlink it
        if visible:
            result = run(retrieve_worker, Job(server.url, 8 * BLOCKS_PER_CHUNK, None, hashes,
                                              chunk_blocks(reversed(range(8))), shape=W1))
            assert result.retrieved == visible
            assert torch.equal(result.blocks, expected_blocks(
                8 * BLOCKS_PER_CHUNK, 21, chunk_blocks(range(visible)), W1))


def test_sigterm_finishes_in_flight_work_releases_everything_and_exits_0():
    before = shm_segments()
    with run_server("--cpu-size", "512MiB", "--log-level", "info") as server:
        with CacheClient(server.url, timeout=20) as client, \
                make_cache(8 * BLOCKS_PER_CHUNK, 4, W1) as cache:
            registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                     block_size=16)
            pending = client.rpc.submit(StoreRequest(registration.instance_id, [
                TransferItem.build("r", prompt(95, 8), chunk_blocks(range(8)))]))
            # Read by the server (its count of STOREs), so in flight or done: not refused.
            wait_for(lambda: client.stats().requests.get("STORE"), "the STORE read")
            assert server.stop() == 0
            reply = pending.result(timeout=20)
            assert isinstance(reply, StoreReply)
            with pytest.raises(RequestTimeout):
                client.ping(timeout=0.5)
        log = server.output()
        assert "releasing 1 registrations" in log
        assert "shutdown: done" in log
    assert shm_segments() - before == set()  # nothing left behind by server or worker



@pytest.mark.parametrize("taken", ["the fd channel (same runtime directory)",
                                   "the ipc socket (same --url)", "the tcp port",
                                   "the metrics port"])
def test_a_start_refused_for_an_address_in_use_leaves_no_files(tmp_path, taken):
    """Whatever another process serves, the refused server (exit 1) has made no disk
    directory and no pool segment: the addresses are asked first."""
    disk_dir, segments, log = tmp_path / "disk", tmp_path / "segments", tmp_path / "log"
    args = ["--cpu-size", "4MiB", "--disk-dir", str(disk_dir), "--disk-size", "8MiB",
            "--pool-segment", "pool", "--pool-segment-dir", str(segments)]
    log.touch()
    with run_server() as first, socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        url, runtime_dir = ipc_url(), tmp_path / "run"
        if taken.startswith("the fd channel"):
            runtime_dir = first.runtime_dir
        elif taken.startswith("the ipc socket"):
            url = first.url
        elif taken == "the tcp port":
            url = f"tcp://127.0.0.1:{port}"
        else:
            args += ["--metrics-port", str(port)]
        # Not a ServerProcess: its close() would remove the first server's socket file.
        second = ForkedServer(context(), ["--url", url, "--runtime-dir", str(runtime_dir),
                                          *args], str(log))
        assert second.wait(60) == 1
        assert "another process is listening on it" in log.read_text()
        assert not disk_dir.exists() and not segments.exists()
        with first.client() as client:
            client.ping()  # the server that holds the address serves on


def test_the_pool_is_given_back_before_the_last_line_and_the_exit_follows_it():
    """The pool's pages are freed as a logged step of shutdown, not by the process's exit
    after `shutdown: done`: the exit then has little left to do."""
    server = server_process(None, ["--cpu-size", "256MiB", "--log-level", "info"])
    server.start()
    try:
        with server.client(admin=True) as admin:
            server.wait_prefault(admin)
        started_process(server).send_signal(signal.SIGTERM)
        wait_for(lambda: "shutdown: done" in server.output(), "shutdown: done logged")
        done = time.monotonic()
        code = started_process(server).wait(60)  # a bound on a hang only
        exited_after = time.monotonic() - done
    finally:
        server.close()
    log = server.output()
    assert code == 0
    assert re.search(r"shutdown: giving the CPU pool's 256\.0MiB back to the system.*\n.*"
                     r"shutdown: done", log)
    assert exited_after < 30


def anonymous_kib() -> int:
    """Anonymous memory this process has mapped and touched (/proc/self/status RssAnon)."""
    with open("/proc/self/status") as status:
        found = re.search(r"RssAnon:\s+(\d+) kB", status.read())
    assert found is not None
    return int(found.group(1))


def test_give_back_frees_an_anonymous_pools_memory_but_keeps_a_segments_bytes(tmp_path):
    pool = CpuPool(64 * 1024**2)
    pool.start_prefault()
    assert pool.prefault_done.wait(60)
    touched = anonymous_kib()
    pool.close()
    pool.give_back()
    assert touched - anonymous_kib() >= 60 * 1024  # the 64 MiB are no longer this process's
    assert pool.array[::4096].sum() == 0  # still mapped: zeros
    segment = tmp_path / "segment"
    with open(segment, "w+b") as file:
        file.truncate(8 * 1024**2)
        kept = CpuPool(8 * 1024**2, fd=file.fileno())
        kept.array[:4] = [1, 2, 3, 4]
        kept.close()
        kept.give_back()
        assert file.read(4) == bytes([1, 2, 3, 4])
