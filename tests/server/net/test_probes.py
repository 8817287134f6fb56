"""/healthz and /readyz of a real server: not ready while the pool faults in or the server
shuts down; not healthy while its event loop is stuck. And JSON log lines that parse."""

import json
import os
import signal
import threading
import time

import pytest

from lmcache_mp.client import StoreStatus, TransferItem
from lmcache_mp.errors import BadRequest

from ...utils import free_port, run_server, started_process
from ...workers import BLOCKS_PER_CHUNK, MODEL, chunk_blocks, make_cache, prompt
from ..http_probe import get, scrape, value


def poll(port: int, path: str, until, timeout: float = 60.0) -> list[tuple[int, str]]:
    """GET `path` until `until(status, body)` holds; every answer seen, in order."""
    seen = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            seen.append(get(port, path, timeout=timeout))
        except ConnectionError:
            seen.append((0, "connection refused"))
        if until(*seen[-1]):
            return seen
        assert time.monotonic() < deadline, seen[-5:]
        time.sleep(0.005)


def test_not_ready_while_the_pool_faults_in():
    port = free_port()
    # A pool big enough that faulting it in takes a while after the server answers.
    with run_server("--cpu-size", "2GiB", "--metrics-port", str(port)) as server, \
            server.client() as client:
        seen = poll(port, "/readyz", lambda status, body: status == 200)
        assert (503, "the pool is being faulted in\n") in seen, seen[:3]
        assert client.stats().prefault_done
        assert value(scrape(port), "lmcache_mp_pool_prefault_done") == 1
        assert get(port, "/healthz")[0] == 200  # alive all along


def test_not_ready_while_shutting_down():
    """SIGTERM while a large STORE copies: /readyz says so until the endpoint closes, and the
    drained STORE still completes."""
    port = free_port()
    chunks = 1024  # 512 MiB: its copy outlasts many polls
    with make_cache(chunks * BLOCKS_PER_CHUNK, None) as cache, \
            run_server("--cpu-size", "640MiB", "--copy-threads", "1", "--shutdown-timeout", "120",
                       "--metrics-port", str(port)) as server:
        poll(port, "/readyz", lambda status, body: status == 200)
        with server.client(timeout=120) as client, server.client() as observer:
            registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                     block_size=16)
            results = []
            storing = threading.Thread(target=lambda: results.append(client.store(
                registration, [TransferItem.build("big", prompt(1, chunks),
                                                  chunk_blocks(list(range(chunks))))])))
            storing.start()
            while observer.stats().pending_stores == 0:
                assert storing.is_alive()
            started_process(server).send_signal(signal.SIGTERM)
            seen = poll(port, "/readyz", lambda status, body: status != 200)
            storing.join(120)
        assert seen[-1] == (503, "shutting down\n")
        assert list(results[0][0]) == [StoreStatus.STORED] * chunks
        assert started_process(server).wait(120) == 0


def test_not_healthy_while_the_loop_is_stuck(tmp_path):
    """A SIGHUP makes the loop read --quota-file; a FIFO nobody writes holds that read up,
    as a hung network file system would: the loop stops turning, and /healthz sees it."""
    fifo = tmp_path / "quotas.toml"
    os.mkfifo(fifo)

    def feed_quotas() -> None:
        with open(fifo, "w") as writer:  # waits for the server to open it
            writer.write('[quotas]\n"team" = "1MiB"\n')
    feeder = threading.Thread(target=feed_quotas)
    feeder.start()
    port = free_port()
    with run_server("--quota-file", str(fifo), "--metrics-port", str(port),
                    "--loop-stall-timeout", "1") as server:
        feeder.join(60)
        assert get(port, "/healthz") == (200, "ok\n")
        started_process(server).send_signal(signal.SIGHUP)
        seen = poll(port, "/healthz", lambda status, body: status != 200)
        assert seen[-1][0] == 503 and "has not turned for" in seen[-1][1]
        status, body = get(port, "/metrics")
        assert status == 503 and "did not answer" in body
        assert get(port, "/readyz")[0] == 200  # readiness is another question
        feeder = threading.Thread(target=feed_quotas)
        feeder.start()
        feeder.join(60)
        poll(port, "/healthz", lambda status, body: status == 200)
        assert value(scrape(port), "lmcache_mp_event_loop_lag_seconds") >= 0
        with server.client(admin=True) as client:
            assert client.stats().loop_lag_seconds >= 0


def test_json_log_lines_parse():
    with run_server("--log-format", "json", "--log-level", "debug") as server, \
            server.client() as client:
        with pytest.raises(BadRequest):
            client.lookup(MODEL, 0, [])
    lines = [json.loads(line) for line in server.output().splitlines()]
    messages = [line["message"] for line in lines]
    assert any(m.startswith("configuration: ") for m in messages)
    assert any(m.startswith("lmcache-mp-server ") and "serving on" in m for m in messages)
    assert "shutdown: done" in messages
    (refusal,) = [line for line in lines if line.get("outcome") == "bad_request"]
    assert refusal["op"] == "LOOKUP" and refusal["level"] == "debug"
    assert isinstance(refusal["request_id"], int) and refusal["client"]
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
