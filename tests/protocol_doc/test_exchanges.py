"""The example exchange of docs/protocol.md, replayed frame by frame against a fresh server on
the connections it names (the worker's, the administrator's with the admin token, and a
stranger's without HELLO), gets exactly the replies the document shows, and the KV bytes
really move; a batch is validated before anything is applied; malformed frames get the
error replies the document promises and the server keeps serving."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import struct
from typing import Any

import msgpack

from lmcache_mp import protocol
from lmcache_mp.client import SharedKVCache, chunk_hashes
from lmcache_mp.protocol import MAX_KV_WORLD_SIZE, MAX_REQUEST_ID_CHARS
from lmcache_mp.spawn import ServerProcess

from ..utils import rid
from .document import (
    Placeholder,
    fenced_blocks,
    parse_exchange,
    section,
    substitute,
)
from .wire import (
    call,
    check_reply,
    dealer,
    exchange,
    fd_socket,
    refused,
    running_server,
    session,
    ticket_for,
    wire_handles,
)

# ---------------------------------------------------------------------------
# The example exchange, replayed.

# The connection each block of "## Example exchange" runs on, as its prose says.
EXAMPLE_CONNECTIONS = ["worker", "admin", "worker", "stranger"]


def test_example_exchange_replays_against_a_real_server() -> None:
    lines = section("## Example exchange")
    blocks = fenced_blocks(lines, "text")
    assert len(blocks) == len(EXAMPLE_CONNECTIONS)
    per_block = [parse_exchange(block) for block in blocks]
    for messages in per_block:
        assert [m[0] for m in messages] == ["C", "S"] * (len(messages) // 2)
    worker, quota, errors_block, stranger = per_block
    assert [m[2] for m in worker[0::2]] == ["HELLO", "REGISTER_KV_CACHE", "STORE", "LOOKUP",
                                            "RETRIEVE", "END_SESSION", "UNREGISTER_KV_CACHE"]
    assert [m[2] for m in quota[0::2]] == \
        ["HELLO", "QUOTA_SET", "LOOKUP", "QUOTA_GET", "QUOTA_LIST", "QUOTA_DELETE"]
    assert quota[0][3]["token"] == Placeholder("admin_token") and quota[1][3]["role"] == "admin"
    assert worker[1][3]["role"] == "engine" and "token" not in worker[0][3]
    # The error examples: bad_request and forbidden on the worker's connection, then
    # unauthenticated on a connection without a session, and for a wrong token.
    assert [m[3]["code"] for m in errors_block[1::2]] == ["bad_request", "forbidden"]
    assert [(m[2], m[3]["code"]) for m in stranger[1::2]] == \
        [("err", "unauthenticated"), ("err", "unauthenticated")]
    assert stranger[0][2] != "HELLO" and stranger[2][2] == "HELLO"
    # "a cap of one chunk": the cap is the chunk_bytes the registration reported.
    register_reply = next(m[3] for m in worker if m[0] == "S" and "chunk_bytes" in m[3])
    assert quota[2][3]["cap"] == register_reply["chunk_bytes"]
    # Request ids count up from 1 on each connection: the worker's go on in its errors.
    for name in set(EXAMPLE_CONNECTIONS):
        sent = [m[1] for block, conn in zip(per_block, EXAMPLE_CONNECTIONS) if conn == name
                for m in block[0::2]]
        assert sent == [rid(n) for n in range(1, len(sent) + 1)], name
    prose = re.sub(r"\s+", " ", " ".join(lines))
    assert "on a connection of its own (request ids count from 1 again)" in prose
    assert "on the worker's connection" in prose and "on a new connection" in prose

    kv = SharedKVCache("mha", num_layers=2, num_blocks=16, block_size=128, heads=1, head_dim=8)
    try:
        # Distinct contents per block, so that a block landing in the wrong place shows.
        for i in range(len(kv.layers)):
            kv.layers[i].copy_(kv.layers[i].new_empty(kv.layers[i].shape).normal_())
        before = kv.blocks(list(range(16)))
        with running_server() as running, contextlib.ExitStack() as stack:
            bound: dict[str, Any] = {"admin_token": running.token(admin=True)}
            socks = {name: stack.enter_context(dealer(running.url))
                     for name in set(EXAMPLE_CONNECTIONS)}
            for name, messages in zip(EXAMPLE_CONNECTIONS, per_block):
                sock = socks[name]
                for (_, request_id, op, request), (_, reply_id, status, expected) in zip(
                        messages[0::2], messages[1::2]):
                    assert reply_id == request_id
                    request = substitute(request, bound)
                    if op == "REGISTER_KV_CACHE":
                        assert [dict(h, ticket=None) for h in request["layers"]] == \
                            [dict(dataclasses.asdict(h), ticket=None, name="lmcache_mp_example")
                             for h in kv.handles()]
                        # The id is the server's choice: the document must not show a literal one.
                        assert expected["instance_id"] == Placeholder("instance_id")
                    got_id, got_status, got = exchange(
                        sock, [request_id, op.encode(), msgpack.packb(request, use_bin_type=True)])
                    assert (got_id, got_status.decode()) == (request_id, status), got
                    check_reply(op, got, expected, bound)
                    if op == "HELLO" and name == "worker":
                        # What the comment line says happens next: the memfd goes to the
                        # fd channel, and its ticket comes back.
                        assert bound["fd_socket"] == fd_socket(running)
                        bound["ticket"] = ticket_for(bound["fd_socket"], kv,
                                                     bound["fd_binding"])
            instance_id = bound["instance_id"]
            assert type(instance_id) is int and 1 <= instance_id < 2**53, instance_id
            assert len(bound["ticket"]) == protocol.TICKET_BYTES
        after = kv.blocks(list(range(16)))
        # RETRIEVE put chunks 0-1 (blocks 0-3) into blocks 4-7 and wrote nothing else.
        assert after[:, :, 4:8].equal(before[:, :, 0:4])
        assert after[:, :, :4].equal(before[:, :, :4])
        assert after[:, :, 8:].equal(before[:, :, 8:])
    finally:
        kv.close()


def test_a_batch_is_validated_before_anything_is_applied(server: ServerProcess) -> None:
    kv = SharedKVCache("mha", num_layers=1, num_blocks=8, block_size=128, heads=1, head_dim=8)
    try:
        hashes = chunk_hashes(list(range(1000, 1512)), 256)
        with session(server) as sock:
            reg = call(sock, 1, "REGISTER_KV_CACHE", {
                "model": "batch-model", "kv_world_size": 1, "kv_worker_id": 0, "layout": "mha",
                "block_size": 128, "layers": wire_handles(kv, fd_socket(server))})
            good = {"request_id": "a", "chunk_hashes": hashes[0],
                    "block_ids": struct.pack("<2i", 0, 1)}
            bad = {"request_id": "b", "chunk_hashes": hashes[1],
                   "block_ids": struct.pack("<2i", 2, 99)}
            err = refused(sock, 2, "STORE",
                          {"instance_id": reg["instance_id"], "items": [good, bad]})
            assert err["code"] == "bad_request" and "items[1].block_ids" in err["message"]
            lookup = {"model": "batch-model", "kv_world_size": 1,
                      "items": [{"request_id": "c", "chunk_hashes": hashes[0]}]}
            assert call(sock, 3, "LOOKUP", lookup) == {"hits": [0]}
            assert call(sock, 4, "STORE", {"instance_id": reg["instance_id"], "items": [good]}) == \
                {"results": [bytes([protocol.StoreStatus.STORED])]}
            assert call(sock, 5, "LOOKUP", lookup) == {"hits": [1]}
            assert call(sock, 6, "UNREGISTER_KV_CACHE", {"instance_id": reg["instance_id"]}) == {}
    finally:
        kv.close()


# ---------------------------------------------------------------------------
# Malformed frames.

def test_malformed_frames_get_error_replies_and_the_server_keeps_serving(
        server: ServerProcess) -> None:
    empty = msgpack.packb({})
    cases = [
        ([b"\x01\x02", b"PING", empty], rid(0), "bad_frame"),  # unreadable id: answered as id 0
        ([rid(7)], rid(7), "bad_frame"),
        ([rid(8), b"PING", empty, b"extra"], rid(8), "bad_frame"),
        ([rid(9), b"\xff", empty], rid(9), "bad_frame"),
        ([rid(10), b"NO_SUCH_OP", empty], rid(10), "unknown_op"),
        ([rid(11), b"PING", b"\xc1"], rid(11), "bad_request"),
        ([rid(12), b"PING", msgpack.packb([1])], rid(12), "bad_request"),
        ([rid(13), b"HELLO", msgpack.packb({})], rid(13), "bad_request"),
        ([rid(14), b"HELLO", msgpack.packb({"protocol_version": True})], rid(14), "bad_request"),
        ([rid(15), b"HELLO", msgpack.packb({"protocol_version": 1})], rid(15),
         "unsupported_version"),
        ([rid(32), b"HELLO", msgpack.packb({"protocol_version": 3})], rid(32),
         "unsupported_version"),
        ([rid(33), b"HELLO", msgpack.packb({"protocol_version": 2, "engine": "e" * 257})], rid(33),
         "bad_request"),
        ([rid(16), b"STORE", msgpack.packb({"instance_id": 12345, "items": []})], rid(16),
         "unknown_instance"),
        ([rid(17), b"LOOKUP", msgpack.packb({"model": "m", "kv_world_size": 1, "items": [
            {"request_id": "r", "chunk_hashes": "not bin"}]})], rid(17), "bad_request"),
        ([rid(18), b"LOOKUP", msgpack.packb({"model": "m", "kv_world_size": 1, "items": [
            {"request_id": "r", "chunk_hashes": b"x" * 15}]})], rid(18), "bad_request"),
        ([rid(19), b"LOOKUP", msgpack.packb({"model": "m", "kv_world_size": 1, "items": [
            {"request_id": "r", "chunk_hashes": b"", "cache_salt": "s" * 257}]})], rid(19),
         "bad_request"),
        ([rid(20), b"LOOKUP", msgpack.packb({"model": "m", "kv_world_size": 1, "items": [
            {"request_id": "r" * 513, "chunk_hashes": b"", "hold": True}]})], rid(20),
         "bad_request"),
        # Request id 0 is reserved: refused, and answered with id 0.
        ([rid(0), b"PING", empty], rid(0), "bad_frame"),
        # request_id is checked everywhere it appears, hold or not.
        ([rid(24), b"LOOKUP", msgpack.packb({"model": "m", "kv_world_size": 1, "items": [
            {"request_id": "r" * 513, "chunk_hashes": b""}]})], rid(24), "bad_request"),
        ([rid(25), b"RELEASE", msgpack.packb({"items": [{"request_id": "r" * 513}]})], rid(25),
         "bad_request"),
        ([rid(26), b"END_SESSION", msgpack.packb({"request_id": "r" * 513})], rid(26),
         "bad_request"),
        # The salt rule covers the whole string.
        ([rid(27), b"LOOKUP", msgpack.packb({"model": "m", "kv_world_size": 1, "items": [
            {"request_id": "r", "chunk_hashes": b"", "cache_salt": "salt\n"}]})], rid(27),
         "bad_request"),
        ([rid(28), b"END_SESSION", msgpack.packb({"request_id": "r", "cache_salt": "salt\n"})],
         rid(28), "bad_request"),
        # kv_world_size is 1 to 1024.
        ([rid(29), b"LOOKUP", msgpack.packb({"model": "m", "kv_world_size": 0, "items": []})],
         rid(29), "bad_request"),
        ([rid(30), b"LOOKUP", msgpack.packb({"model": "m", "kv_world_size": 1025, "items": []})],
         rid(30), "bad_request"),
    ]
    with session(server) as sock:
        for frames, reply_id, code in cases:
            got_id, status, payload = exchange(sock, frames)
            assert (got_id, status, payload["code"]) == (reply_id, b"err", code), (frames, payload)
            assert isinstance(payload["message"], str) and payload["message"]
        # A refused HELLO left the session alone. Unknown fields are ignored, optional ones
        # take their defaults, and it still serves.
        _, status, hello_reply = exchange(sock, [rid(21), b"HELLO", msgpack.packb(
            {"protocol_version": 2, "from_the_future": {"x": [1, 2]}})])
        assert status == b"ok" and hello_reply["protocol_version"] == 2
        assert hello_reply["role"] == "engine"
        _, status, ping = exchange(sock, [rid(22), b"PING", msgpack.packb({})])
        assert status == b"ok" and isinstance(ping["server_time"], float)
        _, status, released = exchange(sock, [rid(23), b"END_SESSION", msgpack.packb(
            {"request_id": "nobody"})])
        assert (status, released) == (b"ok", {"released": 0})
        # The longest request_id and a kv_world_size of 1024 are fine.
        _, status, lookup = exchange(sock, [rid(31), b"LOOKUP", msgpack.packb({
            "model": "m", "kv_world_size": MAX_KV_WORLD_SIZE,
            "items": [{"request_id": "r" * MAX_REQUEST_ID_CHARS, "chunk_hashes": b"",
                       "hold": True}]})])
        assert (status, lookup) == (b"ok", {"hits": [0]})


# ---------------------------------------------------------------------------
