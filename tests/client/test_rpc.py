"""The client transport against real servers: timeouts, restarts, late replies, threads."""

import signal
import threading
import time
from concurrent.futures import wait

import pytest
import torch

from lmcache_mp.client import CacheClient, LookupItem, RpcClient, StoreStatus, TransferItem
from lmcache_mp.errors import RequestTimeout, ServerUnavailable
from lmcache_mp.protocol import PingReply, PingRequest, StatsReply, StatsRequest, StoreRequest

from ..utils import ipc_url, lines_run, run_server, server_process, started_process, stop_process
from ..workers import BLOCKS_PER_CHUNK, MODEL, chunk_blocks, make_cache, prompt

W1 = dict(layout="mha", num_layers=32, block_size=16, heads=8, head_dim=128, dtype=torch.float16)


def test_no_server_means_a_clear_error_in_bounded_time():
    with RpcClient(ipc_url(), timeout=0.5) as client:
        start = time.monotonic()
        with pytest.raises(RequestTimeout, match="could not reach .* is the server up"):
            client.call(PingRequest())
        # Its own 0.5 s, not a hang: the bound only catches a wait of many timeouts.
        assert time.monotonic() - start < 30


def test_closed_client_refuses_calls_and_fails_pending_ones():
    client = RpcClient(ipc_url(), timeout=30)
    pending = client.submit(PingRequest())
    client.close()
    with pytest.raises(ServerUnavailable, match="closed"):
        pending.result(timeout=5)
    with pytest.raises(ServerUnavailable, match="closed"):
        client.submit(PingRequest())


def test_reconnects_and_registers_again_after_a_server_restart():
    url = ipc_url()
    with make_cache(4 * BLOCKS_PER_CHUNK, 8) as cache, CacheClient(url, timeout=2) as client:
        with run_server(url=url):
            registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                    block_size=16)
            first_id = registration.instance_id
            client.store(registration, [TransferItem.build("a", prompt(1, 1), chunk_blocks([0]))])
        with pytest.raises(RequestTimeout):
            client.ping(timeout=0.3)
        with run_server(url=url):
            hashes = prompt(2, 2)
            statuses = client.store(registration, [TransferItem.build("b", hashes,
                                                                      chunk_blocks([1, 2]))])
            assert statuses == [bytes([StoreStatus.STORED] * 2)]
            assert registration.instance_id != first_id
            assert client.lookup(MODEL, 1, [LookupItem.build("c", hashes)]) == [2]
            assert client.lookup(MODEL, 1, [LookupItem.build("d", prompt(1, 1))]) == [0]


def test_the_first_call_after_a_restart_while_idle_reads_the_old_loss_before_it_sends():
    """Nothing read the monitor while the client was idle: the old connection's loss must be
    read before the call goes out on the new one, or reading it after would fail the call."""
    url = ipc_url()
    with CacheClient(url, timeout=5) as client:
        with run_server(url=url):
            client.ping()
        with run_server(url=url):
            client.ping()
            client.ping()
        assert client.disconnects == 1


def test_a_call_reads_the_monitor_only_when_no_read_is_recent(server):
    """Back-to-back calls: each wait on the socket watches the monitor too, so no call
    tests it again before its send; a call after a pause does."""
    with CacheClient(server.url, timeout=10) as client:
        client.ping()
        # The least of a few: a thread descheduled past _MONITOR_FRESH_S reads it again.
        back_to_back = min(lines_run(client.ping)[1] for _ in range(5))
        time.sleep(0.05)  # past _MONITOR_FRESH_S
        _, after_a_pause = lines_run(client.ping)
        assert back_to_back < after_a_pause
        assert back_to_back < 170  # 132 on Python 3.11 (206 before issue 16's thirteenth round)


def test_a_late_reply_is_dropped_not_given_to_the_next_call():
    with run_server("--cpu-size", "512MiB") as server, CacheClient(server.url) as client, \
            make_cache(8 * BLOCKS_PER_CHUNK, 2, W1) as cache:
        registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                block_size=16)
        store = StoreRequest(registration.instance_id, [
            TransferItem.build("slow", prompt(3, 8), chunk_blocks(range(8)))])
        with pytest.raises(RequestTimeout, match="no reply"):
            client.rpc.call(store, timeout=0.002)
        assert isinstance(client.rpc.call(PingRequest()), PingReply)
        deadline = time.monotonic() + 10
        while client.stats().pending_stores or client.stats().chunks < 8:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert isinstance(client.rpc.call(StatsRequest()), StatsReply)


def test_many_threads_share_one_client_and_get_their_own_replies(server):
    errors: list[tuple[int, Exception]] = []

    def work(n: int) -> None:
        try:
            items = [LookupItem.build(f"t{n}-{i}", prompt(1000 + n, 1)) for i in range(n + 1)]
            for _ in range(50):
                assert client.lookup(MODEL, 1, items) == [0] * (n + 1)
        except Exception as exc:  # reported below, with the thread that saw it
            errors.append((n, exc))

    with CacheClient(server.url) as client:
        threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert errors == []


def test_submitted_futures_complete_without_anyone_waiting(server):
    with RpcClient(server.url) as client:
        futures = [client.submit(PingRequest()) for _ in range(50)]
        done, not_done = wait(futures, timeout=10)
        assert not not_done
        assert all(isinstance(f.result(), PingReply) for f in done)


def test_replies_a_caller_leaves_unread_reach_their_futures(server):
    """A call() returns as soon as its own reply is read, leaving replies that came with it
    in the socket: the background thread reads them for the futures nobody waits on."""
    with RpcClient(server.url) as client:
        for _ in range(20):
            futures = [client.submit(PingRequest()) for _ in range(5)]
            assert isinstance(client.call(PingRequest()), PingReply)
            done, not_done = wait(futures, timeout=10)
            assert not not_done and all(isinstance(f.result(), PingReply) for f in done)


def test_wait_reads_replies_on_the_waiting_thread_and_ends_at_its_timeout(server, monkeypatch):
    """RpcClient.wait leads the socket itself: each reply is resolved on the thread that
    waits (no hand-off from the background thread), also while the background thread was
    leading when the wait began; and a wait ends at its timeout, not at the reply."""
    with RpcClient(server.url) as client:
        client.call(PingRequest())  # HELLO is answered: nothing else in flight
        for _ in range(20):
            resolved_on: list[str] = []
            futures = [client.submit(PingRequest()) for _ in range(3)]
            # bound now: a callback that runs late appends to its own round's list
            def note_thread(_: object, out: list[str] = resolved_on) -> None:
                out.append(threading.current_thread().name)
            for future in futures:
                future.add_done_callback(note_thread)
            client.wait(futures, 10)
            assert all(future.done() for future in futures)
            if resolved_on == [threading.current_thread().name] * 3:
                break
        else:  # the background thread may win a race now and then, not every time
            pytest.fail(f"replies were resolved on {resolved_on}, never all on the waiter")

    with server_process() as srv, RpcClient(srv.url, timeout=30) as client:
        client.call(PingRequest())
        pumps: dict[str, int] = {}
        pump = client._pump

        def counted_pump(*args) -> None:
            name = threading.current_thread().name
            pumps[name] = pumps.get(name, 0) + 1
            pump(*args)
        monkeypatch.setattr(client, "_pump", counted_pump)
        stop_process(started_process(srv).pid)  # it cannot answer
        try:
            future = client.submit(PingRequest())
            time.sleep(0.1)  # the background thread leads for it meanwhile
            pumps.clear()
            started = time.monotonic()
            client.wait([future], 0.3)
            # At its timeout (a load only makes it later): the bound only ends a wait that
            # would have lasted until the server answered.
            assert 0.25 <= time.monotonic() - started < 30
            assert not future.done()
            # The background thread handed the socket over and stayed away: it once took it
            # back at once, again and again (hundreds of pumps), until the waiter won a race.
            assert pumps.get("lmcache-mp-rpc", 0) <= 3, pumps
        finally:
            started_process(srv).send_signal(signal.SIGCONT)
        client.wait([future], 10)
        assert isinstance(future.result(), PingReply)


def test_heartbeats_keep_an_idle_registration_alive():
    # Heartbeats every second (a third of the timeout): only a 3 s stall of the client's
    # thread would let the registration go; idle for two and a half timeouts.
    with run_server("--worker-timeout", "3") as server, CacheClient(server.url) as client, \
            make_cache(4 * BLOCKS_PER_CHUNK, 8) as cache:
        registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                block_size=16)
        first_id = registration.instance_id
        time.sleep(7.5)
        assert client.stats().registrations == 1
        client.store(registration, [TransferItem.build("a", prompt(4, 1), chunk_blocks([0]))])
        assert registration.instance_id == first_id  # it was never dropped and registered again


def test_a_call_that_must_not_wait_for_the_connection_fails_at_once():
    with RpcClient(ipc_url(), timeout=30) as client:
        future = client.submit(PingRequest(), wait_for_connection=False)
        with pytest.raises(ServerUnavailable, match="not connected"):
            future.result(timeout=5)  # not the call's 30 s


def test_calls_sent_to_a_server_that_dies_fail_on_the_lost_connection():
    """The server stops before it reads a call, then dies: the call fails when the
    connection drops, not at its timeout (no reply can come any more)."""
    server = server_process(None, ["--cpu-size", "64MiB", "--log-level", "warning"])
    server.start()
    try:
        with server.client(timeout=120) as client:
            client.ping()
            stop_process(started_process(server).pid)
            pending = client.rpc.submit(PingRequest())
            killer = threading.Timer(0.2, started_process(server).kill)
            started = time.monotonic()
            killer.start()
            with pytest.raises(ServerUnavailable, match="lost the connection"):
                pending.result(timeout=60)
            killer.join()
            assert time.monotonic() - started < 60  # its timeout is 120 s
            assert client.disconnects == 1
    finally:
        server.close()
