"""No silent loss: every request gets its reply, however slowly its client reads; refused
requests still count and still keep a worker's registrations alive; undecodable ones are
told why; the server cleans up its socket files when it stops."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from lmcache_mp.client import LookupItem, StoreStatus, TransferItem
from lmcache_mp.errors import BadRequest
from lmcache_mp.protocol import (
    LookupRequest,
    RetrieveReply,
    RetrieveRequest,
    StoreReply,
    StoreRequest,
    UnregisterKVCacheRequest,
)

from ..utils import (
    free_port,
    rid,
    run_server,
    server_process,
    started_process,
    stop_process,
    wait_for,
)
from ..workers import BLOCKS_PER_CHUNK, MODEL, W2, chunk_blocks, prompt
from .agents import RawClient, new_cache, raw_bytes

PIPELINED = 20_000
# A registration silent this long goes: a request every 0.2 s keeps it, however loaded the
# machine (only a stall of 3 s would not).
WORKER_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def server():
    with run_server("--worker-timeout", str(WORKER_TIMEOUT_S)) as srv:
        yield srv


@pytest.mark.slow
@pytest.mark.parametrize("hwm", [0, 1], ids=["unbounded queues", "one-message queues"])
def test_pipelined_requests_read_late_all_get_their_replies(server, hwm):
    """20,000 STATS sent without reading, read a second later: 20,000 replies, one per id.
    With one-message queues at the client, the server's pipe to it fills and the replies
    wait in the server's backlog for the client to read."""
    with RawClient(server.url, hwm=hwm, timeout_ms=20_000) as raw, \
            server.client(timeout=60) as watcher:
        raw.hello()
        answered = watcher.stats().requests.get("STATS", 0)
        sent = [raw.send("STATS", {}) for _ in range(PIPELINED)]
        polls = 0

        def all_answered() -> bool:
            nonlocal polls
            polls += 1  # less the watcher's own STATS before this one
            return watcher.stats().requests["STATS"] - answered - polls >= PIPELINED
        wait_for(all_answered, timeout=60, what="every STATS answered")  # while nobody reads
        replies = [raw.recv() for _ in range(PIPELINED)]
        assert [r[0] for r in replies] == sent  # in order, none lost, none doubled
        assert all(status == b"ok" and "requests" in body for _, status, body in replies)
        assert raw.socket.poll(200) == 0  # and nothing more
        status, body = raw.call("PING", {})
        assert status == b"ok"
    server.check_alive()


def test_socket_files_are_removed_when_the_server_stops():
    server = server_process(None, ["--cpu-size", "16MiB", "--log-level", "warning"])
    server.start()
    try:
        sockets = [server.runtime_dir / "server.sock", server.runtime_dir / "fd.sock"]
        assert all(path.is_socket() for path in sockets)
        assert server.stop() == 0
        assert [path.name for path in sockets if path.exists()] == []
    finally:
        server.close()


def test_refused_requests_count_and_keep_registrations_alive(server):
    """Any request that names an op is a sign of life, even one refused as a bad request."""
    with server.client(timeout=10) as worker, server.client(admin=True) as admin, \
            new_cache(2 * BLOCKS_PER_CHUNK, 3, W2) as cache:
        registration = worker.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                block_size=16)
        worker.rpc.heartbeat_interval = None  # only the refused requests below speak for it
        instance_id = registration.instance_id
        counted = admin.stats().requests.get("LOOKUP", 0)
        refused = 0
        deadline = time.monotonic() + 2.5 * WORKER_TIMEOUT_S
        while time.monotonic() < deadline:
            with pytest.raises(BadRequest, match=r"`kv_world_size`: must be in \[1, 1024\]"):
                worker.rpc.call(LookupRequest(MODEL, 0, []))
            refused += 1
            time.sleep(0.2)
        stats = admin.stats()
        assert stats.requests["LOOKUP"] == counted + refused
        assert [i.instance_id for i in stats.instances] == [instance_id]
        hashes = prompt(40, 2)
        assert worker.store(registration, [TransferItem.build("r", hashes, chunk_blocks(
            [0, 1]))]) == [bytes([StoreStatus.STORED] * 2)]
        assert registration.instance_id == instance_id  # not registered again
        # Silent, it goes at --worker-timeout.
        wait_for(lambda: admin.stats().registrations == 0, timeout=60,
                 what="the silent worker's registration dropped")


def float64(instance_id: float) -> Any:
    """An id as a float64 on the wire; typed Any, as the request dataclasses say int."""
    return float(instance_id)


def test_an_instance_id_sent_as_an_integral_float64_is_accepted(server):
    """JavaScript's msgpack encoders send integers above 2^32 as float64."""
    with server.client(timeout=10) as client, new_cache(2 * BLOCKS_PER_CHUNK, 4, W2) as source, \
            new_cache(2 * BLOCKS_PER_CHUNK, None, W2) as target:
        sent = client.register_kv_cache(source.handles(), model=MODEL, layout="mha",
                                        block_size=16)
        received = client.register_kv_cache(target.handles(), model=MODEL, layout="mha",
                                            block_size=16)
        assert sent.instance_id > 2**32 or received.instance_id > 2**32  # random 53-bit ids
        hashes = prompt(41, 2)
        assert client.rpc.call(StoreRequest(float64(sent.instance_id), [TransferItem.build(
            "f", hashes, chunk_blocks([0, 1]))])) == StoreReply([bytes([StoreStatus.STORED] * 2)])
        client.lookup(MODEL, 1, [LookupItem.build("f", hashes, hold=True)])
        assert client.rpc.call(RetrieveRequest(float64(received.instance_id), [TransferItem.build(
            "f", hashes, chunk_blocks([1, 0]))])) == RetrieveReply([2])
        assert raw_bytes(target.blocks(chunk_blocks([1, 0]))) == \
            raw_bytes(source.blocks(chunk_blocks([0, 1])))
        for wrong in (1.5, float(2**53 + 2), float("nan")):  # not integral, or not exact
            with pytest.raises(BadRequest, match="`instance_id`: expected int, got float"):
                client.rpc.call(UnregisterKVCacheRequest(float64(wrong)))
        for registration in (sent, received):
            client.rpc.call(UnregisterKVCacheRequest(float64(registration.instance_id)))
        assert client.stats().registrations == 0


UNDECODABLE = {
    "a reserved byte": b"\xc1",
    "nested too deep": b"\x91" * 2000 + b"\xc0",
    "cut short": b"\x92\x01",
    "a string cut short": b"\xd9\x05ab",
    "extra bytes": b"\x80\x80",
    "not UTF-8": b"\xa2\xff\xfe",
}


def test_undecodable_msgpack_is_refused_with_a_reason(server):
    with RawClient(server.url) as raw:
        raw.hello()
        for label, payload in UNDECODABLE.items():
            request_id = raw.send("LOOKUP", payload)
            reply_id, status, body = raw.recv()
            assert (reply_id, status, body["code"]) == (request_id, b"err", "bad_request"), label
            match = re.fullmatch(r"payload is not valid msgpack \((\w+): (.*)\)", body["message"])
            assert match and match[2].strip(), (label, body["message"])
        # Frames, too: a short request id is answered with id 0.
        raw.socket.send_multipart([b"\x01", b"PING", b"\x80"])
        assert raw.recv()[:2] == (0, b"err")
        assert raw.call("PING", {})[0] == b"ok"


def test_a_registration_is_answered_while_the_pool_prefaults():
    server = server_process(None, ["--cpu-size", "2GiB", "--log-level", "warning"])
    server.start()
    try:
        with server.client(timeout=10) as client, new_cache(2 * BLOCKS_PER_CHUNK, 5, W2) as cache:
            assert client.stats().prefault_done is False
            registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                    block_size=16)
            hashes = prompt(42, 1)
            assert client.store(registration, [TransferItem.build("p", hashes, chunk_blocks(
                [0]))]) == [bytes([StoreStatus.STORED])]
            assert client.stats().prefault_done is False  # it really was still faulting
            client.unregister(registration)
        stopping = time.monotonic()
        assert server.stop() == 0  # mid-prefault too
        assert time.monotonic() - stopping < 10
    finally:
        server.close()


def test_bad_frames_from_a_connection_without_session_get_one_reply_each(server):
    with RawClient(server.url) as raw:
        for op, payload in (("STATS", {}), ("CLEAR", {}), ("LOOKUP", {
                "model": MODEL, "kv_world_size": 1, "items": []})):
            status, body = raw.call(op, payload)
            assert (status, body["code"]) == (b"err", "unauthenticated"), op
        raw.socket.send_multipart([rid(7), b"NOPE", b"\x80"])
        assert raw.recv()[:2] == (7, b"err")
        assert raw.call("PING", {})[0] == b"ok"  # heartbeats need no session


def _bytes_queued_for(port: int) -> int:
    """Bytes the kernel holds, unread, on the server's side of the TCP connections to `port`
    (/proc/net/tcp's rx_queue of the sockets whose local port it is)."""
    queued = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":  # ESTABLISHED
            queued += int(fields[4].split(":")[1], 16)
    return queued


def test_requests_sent_just_before_sigterm_are_each_answered():
    """900 pipelined requests (under ZeroMQ's receive high-water mark of 1,000), SIGTERM
    right behind them: each gets exactly one reply, served or `shutting_down`. The server
    answers what still arrives until its socket has been quiet, rather than closing it
    under requests ZeroMQ is still delivering (RETRIEVEs sent ~5 ms before a SIGTERM got no
    reply). The order is the test's, not the machine's: the server is stopped (SIGSTOP, every
    thread of it, before the first request is sent) while the requests are sent, the signal
    is sent once the kernel holds every byte of them for the server, and only then does it
    run again."""
    port = free_port()
    with run_server(url=f"tcp://127.0.0.1:{port}") as stopping, \
            RawClient(stopping.url, timeout_ms=20_000) as raw:
        raw.hello(stopping.token())
        process = started_process(stopping)
        stop_process(process.pid)
        try:
            sent = {raw.send("PING", {}) for _ in range(900)}
            # A PING is three frames of 8, 4 and 1 bytes, each after 2 bytes of ZMTP framing.
            wait_for(lambda: _bytes_queued_for(port) >= 900 * (10 + 6 + 3),
                     "the requests in the server's receive queue")
            process.send_signal(signal.SIGTERM)
        finally:
            process.send_signal(signal.SIGCONT)
        outcomes: dict[int, str] = {}
        while sent - outcomes.keys():
            request_id, status, body = raw.recv()
            assert request_id in sent and request_id not in outcomes
            outcomes[request_id] = "ok" if status == b"ok" else body["code"]
        assert set(outcomes.values()) <= {"ok", "shutting_down"}
        assert started_process(stopping).wait(20) == 0
