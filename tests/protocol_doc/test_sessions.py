"""Sessions behave as docs/protocol.md says: `unauthenticated` before HELLO and for a wrong
token, `forbidden` for every admin op from an engine, HELLO replaces a session, STATS shows
an engine no tenants and only its own engine's registrations, leases belong to an engine,
refused requests are counted, integral floats are ints, the decoding bounds and LOOKUP's
probe limit answer `bad_request`, a client that reads late still gets every reply, and a
registration can only be used by the routing identity that made it."""

from __future__ import annotations

import json
import re
import struct
import uuid
from typing import Any

import msgpack
import zmq

from lmcache_mp import protocol
from lmcache_mp.client import SharedKVCache, chunk_hashes
from lmcache_mp.protocol import MAX_KV_WORLD_SIZE
from lmcache_mp.spawn import ServerProcess

from ..utils import rid, wait_for
from .document import (
    quoted_message,
    section,
)
from .wire import (
    REPLY_TIMEOUT_MS,
    call,
    dealer,
    fd_socket,
    fixed_identity_dealer,
    hello,
    refused,
    session,
    wire_handles,
)

# ---------------------------------------------------------------------------
# Sessions, roles and engines.


def test_sessions_roles_and_engines_work_as_documented(server: ServerProcess) -> None:
    heartbeats = "## Sessions and heartbeats"
    no_session = quoted_message(heartbeats, r'"(this connection has no session:[^"]*)"')
    forbidden = quoted_message(heartbeats, r'"(QUOTA_LIST is an admin op:[^"]*)"')
    S = protocol.StoreStatus
    kv = SharedKVCache("mha", num_layers=1, num_blocks=8, block_size=128, heads=1, head_dim=8)
    hashes = chunk_hashes(list(range(5000, 5512)), 256)
    admin_ops: dict[str, dict[str, Any]] = {
        "CLEAR": {}, "QUOTA_SET": {"cache_salt": "x", "cap": None},
        "QUOTA_GET": {"cache_salt": "x"}, "QUOTA_DELETE": {"cache_salt": "x"}, "QUOTA_LIST": {}}
    assert set(admin_ops) == protocol.ADMIN_OPS
    try:
        with dealer(server.url) as fresh, session(server, admin=True) as admin, \
                session(server, engine="secret-a") as worker_a, \
                session(server, engine="secret-a") as scheduler_a, \
                session(server, engine="secret-b") as other_b:
            requests_before = call(admin, 1, "STATS", {})["requests"]
            # Before HELLO: every op but HELLO and PING is unauthenticated, whatever its
            # payload (it is not even decoded); all of them are counted.
            for n, op in enumerate(["LOOKUP", "STATS", "QUOTA_LIST", "END_SESSION"]):
                payload: dict[str, Any] = (
                    {"model": "m", "kv_world_size": 1, "items": []} if op == "LOOKUP"
                    else {"request_id": "r"} if op == "END_SESSION" else {})
                assert refused(fresh, 10 + n, op, payload) == \
                    {"code": "unauthenticated", "message": no_session}, op
            assert refused(fresh, 14, "LOOKUP", b"\xc1", raw=True)["code"] == "unauthenticated"
            assert isinstance(call(fresh, 15, "PING", {})["server_time"], float)
            requests_after = call(admin, 2, "STATS", {})["requests"]
            assert requests_after["LOOKUP"] - requests_before.get("LOOKUP", 0) == 2
            assert requests_after["QUOTA_LIST"] - requests_before.get("QUOTA_LIST", 0) == 1

            # A wrong token is refused on any endpoint and leaves no session.
            assert refused(fresh, 16, "HELLO", {"protocol_version": 2, "token": "x" * 64})[
                "code"] == "unauthenticated"
            assert refused(fresh, 17, "STATS", {})["code"] == "unauthenticated"
            # An engine may not send admin ops; the admin may. HELLO replaces a session.
            assert hello(fresh, n=18)["role"] == "engine"
            for n, (op, payload) in enumerate(admin_ops.items()):
                assert refused(fresh, 20 + n, op, payload) == {
                    "code": "forbidden",
                    "message": forbidden.replace("QUOTA_LIST", op, 1)}, op
                call(admin, 20 + n, op, payload)
            assert hello(fresh, server.token(admin=True), n=30)["role"] == "admin"
            assert call(fresh, 31, "QUOTA_LIST", {})["default_cap"] is None
            assert hello(fresh, n=32)["role"] == "engine"
            assert refused(fresh, 33, "QUOTA_LIST", {})["code"] == "forbidden"

            # Integral floats are ints; other floats are not.
            lookup = {"model": "engine-model", "kv_world_size": 1.0, "items": [
                {"request_id": "req", "chunk_hashes": b"".join(hashes), "hold": True,
                 "cache_salt": "team-x"}]}
            assert call(worker_a, 40, "LOOKUP", lookup) == {"hits": [0]}
            assert refused(worker_a, 41, "LOOKUP", dict(lookup, kv_world_size=1.5))["message"] \
                == "`kv_world_size`: expected int, got float"

            # Engine A's worker stores; its scheduler's hold belongs to engine A alone.
            reg = call(worker_a, 42, "REGISTER_KV_CACHE", {
                "model": "engine-model", "kv_world_size": 1, "kv_worker_id": 0.0,
                "layout": "mha", "block_size": 128, "layers": wire_handles(kv, fd_socket(server))})
            assert call(worker_a, 43, "STORE", {"instance_id": reg["instance_id"], "items": [
                {"request_id": "w", "chunk_hashes": b"".join(hashes),
                 "block_ids": struct.pack("<4i", 0, 1, 2, 3), "cache_salt": "team-x"}]}) == \
                {"results": [bytes([S.STORED] * 2)]}
            assert call(scheduler_a, 44, "LOOKUP", lookup) == {"hits": [2]}
            for sock in (other_b, admin):  # another engine names another lease
                assert call(sock, 45, "END_SESSION",
                            {"request_id": "req", "cache_salt": "team-x"}) == {"released": 0}
                assert call(sock, 46, "RELEASE", {"items": [
                    {"request_id": "req", "cache_salt": "team-x"}]}) == {"released": 0}
            assert call(admin, 47, "STATS", {})["leases_held"] >= 1
            assert call(worker_a, 48, "END_SESSION",
                        {"request_id": "req", "cache_salt": "team-x"}) == {"released": 2}

            # STATS: an engine sees aggregates and its own engine's registrations; an admin all.
            mine = call(scheduler_a, 50, "STATS", {})
            theirs = call(other_b, 50, "STATS", {})
            everything = call(admin, 50, "STATS", {})
            assert mine["tenants"] == {} and theirs["tenants"] == {}
            assert "team-x" in everything["tenants"]
            assert [i["instance_id"] for i in mine["instances"]] == [reg["instance_id"]]
            assert theirs["instances"] == []
            assert reg["instance_id"] in [i["instance_id"] for i in everything["instances"]]
            assert mine["chunks"] == everything["chunks"] >= 2
            assert "team-x" not in json.dumps(mine) + json.dumps(theirs)

            # A sliced LOOKUP (more than LOOKUP_SLICE_PROBES probes) answers as one would.
            long_prompt = hashes + [bytes([i % 256, i // 256]) * 8 for i in range(4094)]
            assert len(long_prompt) * 1 > protocol.LOOKUP_SLICE_PROBES
            sliced = {"model": "engine-model", "kv_world_size": 1, "items": [
                {"request_id": "long", "chunk_hashes": b"".join(long_prompt), "hold": True,
                 "cache_salt": "team-x"}]}
            assert call(worker_a, 51, "LOOKUP", sliced) == {"hits": [2]}
            assert call(scheduler_a, 52, "END_SESSION", {"request_id": "long",
                                                         "cache_salt": "team-x"}) == {"released": 2}
            assert call(worker_a, 53, "UNREGISTER_KV_CACHE",
                        {"instance_id": reg["instance_id"]}) == {}
    finally:
        kv.close()


def test_decoding_bounds_and_the_lookup_probe_limit(server: ServerProcess) -> None:
    encoding = re.sub(r"\s+", " ", " ".join(section("## Encoding")))
    (quoted,) = re.findall(r'\("(payload holds an array of 1025 elements, more than '
                           r'MAX_ITEMS_PER_MESSAGE allows \(1024: [^"]*\))"\)', encoding)
    probes = quoted_message("### `LOOKUP`", r'\("(`items`: 307200 index probes[^"]*)"\)')
    item = {"request_id": "r", "chunk_hashes": b""}
    with session(server) as sock:
        assert refused(sock, 1, "LOOKUP", {"model": "m", "kv_world_size": 1, "items": [item] * 1025}
                       ) == {"code": "bad_request", "message": quoted}
        assert call(sock, 2, "LOOKUP", {"model": "m", "kv_world_size": 1, "items": [item] * 1024}
                    ) == {"hits": [0] * 1024}
        fields = {f"x{i}": i for i in range(protocol.MAX_MAP_FIELDS)}
        assert "more than MAX_MAP_FIELDS allows (64" in refused(sock, 3, "LOOKUP", {
            "model": "m", "kv_world_size": 1, "items": [], **fields})["message"]
        assert "more than MAX_STRING_BYTES allows (4096" in refused(sock, 4, "LOOKUP", {
            "model": "m" * (protocol.MAX_STRING_BYTES + 1), "kv_world_size": 1,
            "items": []})["message"]
        assert refused(sock, 5, "LOOKUP", msgpack.ExtType(1, b"x"))["code"] == "bad_request"
        assert refused(sock, 6, "LOOKUP", {"model": "m", "kv_world_size": 1024, "items": [
            {"request_id": "r", "chunk_hashes": b"h" * 16 * 300}]}) == \
            {"code": "bad_request", "message": probes}
        # At the limit: 4096 chunks (max_chunks_per_message) x kv_world_size 64 probes.
        assert 4096 * 64 == protocol.MAX_LOOKUP_PROBES
        assert call(sock, 7, "LOOKUP", {"model": "m", "kv_world_size": 64, "items": [
            {"request_id": "r", "chunk_hashes": b"h" * 16 * 4096}]}) == {"hits": [0]}


def test_a_client_that_reads_late_still_gets_every_reply(server: ServerProcess) -> None:
    """Far more replies than ZeroMQ's queues hold wait in the server's backlog."""
    count = 6000  # ZeroMQ queues 1000 messages each way, the kernel a few hundred more
    with session(server) as sock, session(server) as watcher:
        answered = call(watcher, 1, "STATS", {})["requests"].get("STATS", 0)
        for n in range(1, count + 1):
            sock.send_multipart([rid(n), b"STATS", msgpack.packb({})])
        polls = 0

        def all_answered() -> bool:
            nonlocal polls
            polls += 1
            served = call(watcher, 2, "STATS", {})["requests"]["STATS"]
            return served - answered - polls >= count  # less the watcher's own before this
        wait_for(all_answered, "every STATS answered")  # while nobody reads
        got: set[bytes] = set()
        while len(got) < count:
            assert sock.poll(REPLY_TIMEOUT_MS), f"{len(got)} of {count} replies arrived"
            reply_id, status, _ = sock.recv_multipart()
            assert status == b"ok"
            got.add(struct.unpack("<Q", reply_id)[0])
        assert got == set(range(1, count + 1))
        assert call(sock, count + 1, "PING", {})


# Registrations.

def _unknown_instance_message(instance_id: int) -> str:
    """The unknown_instance message as the document quotes it, for this id."""
    (quoted,) = re.findall(r'"(no KV cache with instance_id N is registered by this\s+'
                           r'connection; register it \(again\) first)"',
                           "\n".join(section("## Sessions and heartbeats")))
    return re.sub(r"\s+", " ", quoted).replace(" N ", f" {instance_id} ")


def test_registrations_belong_to_the_routing_identity(server: ServerProcess) -> None:
    kv = SharedKVCache("mha", num_layers=1, num_blocks=8, block_size=128, heads=1, head_dim=8)
    identity = b"lmcache-mp-" + uuid.uuid4().bytes
    context = zmq.Context()
    owner = other = None
    try:
        register = {"model": "owned-model", "kv_world_size": 1, "kv_worker_id": 0,
                    "layout": "mha", "block_size": 128,
                    "layers": wire_handles(kv, fd_socket(server))}
        owner = fixed_identity_dealer(context, server.url, identity)
        hello(owner)
        for bad_size in (0, MAX_KV_WORLD_SIZE + 1):
            err = refused(owner, 1, "REGISTER_KV_CACHE", dict(register, kv_world_size=bad_size))
            assert err["code"] == "bad_request", err
        reg = call(owner, 2, "REGISTER_KV_CACHE", register)
        instance_id = reg["instance_id"]
        assert type(instance_id) is int and 1 <= instance_id < 2**53
        hashes = chunk_hashes(list(range(2000, 2256)), 256)
        item = {"request_id": "owned", "chunk_hashes": hashes[0],
                "block_ids": struct.pack("<2i", 0, 1)}

        # Another connection cannot use it: the same answer as for an id that names nothing.
        other = fixed_identity_dealer(context, server.url, b"lmcache-mp-" + uuid.uuid4().bytes)
        hello(other)
        for n, (op, payload) in enumerate([
                ("STORE", {"instance_id": instance_id, "items": [item]}),
                ("RETRIEVE", {"instance_id": instance_id, "items": [item]}),
                ("UNREGISTER_KV_CACHE", {"instance_id": instance_id})]):
            assert refused(other, 10 + n, op, payload) == {
                "code": "unknown_instance", "message": _unknown_instance_message(instance_id)}

        # While the owner is connected, a second socket with its identity is ignored.
        duplicate = context.socket(zmq.DEALER)
        duplicate.setsockopt(zmq.LINGER, 0)
        duplicate.setsockopt(zmq.ROUTING_ID, identity)
        duplicate.connect(server.url)
        duplicate.send_multipart([rid(15), b"PING", msgpack.packb({})])
        assert not duplicate.poll(300), "the server answered a duplicate identity"
        duplicate.close()

        # The owner reconnects with the same identity: its session and its registration
        # are still there, no HELLO needed.
        owner.close()
        owner = fixed_identity_dealer(context, server.url, identity)
        assert call(owner, 20, "STORE", {"instance_id": instance_id, "items": [item]}) == \
            {"results": [bytes([protocol.StoreStatus.STORED])]}
        assert call(owner, 21, "UNREGISTER_KV_CACHE", {"instance_id": instance_id}) == {}
        assert refused(owner, 22, "UNREGISTER_KV_CACHE", {"instance_id": instance_id})["code"] \
            == "unknown_instance"
    finally:
        for sock in (owner, other):
            if sock is not None:
                sock.close()
        context.term()
        kv.close()
