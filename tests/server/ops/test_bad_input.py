"""Bad frames and bad requests get clear error replies, apply nothing, and the server keeps
serving."""

import re
from typing import Any

import msgpack
import pytest
import torch
import zmq

from lmcache_mp import protocol
from lmcache_mp.client import CacheClient, LookupItem, StoreStatus, TransferItem
from lmcache_mp.errors import BadRequest, TransportError, UnknownInstance
from lmcache_mp.protocol import MAX_REGISTRATIONS_PER_CONNECTION, CudaIpcHandle, MemfdHandle
from lmcache_mp.server.ops.lookup import MAX_VALID_SALTS_KEPT

from ...utils import rid, run_server
from ...workers import BLOCKS_PER_CHUNK, MODEL, chunk_blocks, make_cache, prompt


@pytest.fixture
def raw(server):
    """A bare DEALER socket, to send what no well-behaved client would."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, 5000)
    socket.connect(server.url)
    request_id, status, _ = exchange(socket, [rid(1), b"HELLO", protocol.pack(
        protocol.HelloRequest(protocol.PROTOCOL_VERSION))])
    assert (request_id, status) == (rid(1), b"ok")
    yield socket
    socket.close()
    context.term()


def exchange(socket, frames):
    socket.send_multipart(frames)
    reply = socket.recv_multipart()
    assert len(reply) == 3
    return reply[0], reply[1], msgpack.unpackb(reply[2])


def assert_still_serving(socket):
    request_id, status, payload = exchange(socket, [rid(999), b"PING", msgpack.packb({})])
    assert (request_id, status) == (rid(999), b"ok") and payload["server_time"] > 0


@pytest.mark.parametrize("frames,code,words", [
    ([b"garbage"], "bad_frame", "3 frames"),
    ([rid(1), b"PING"], "bad_frame", "3 frames"),
    ([rid(1), b"PING", b"\x80", b"extra"], "bad_frame", "3 frames"),
    ([b"\x01\x02", b"PING", b"\x80"], "bad_frame", "8 bytes"),
    ([rid(1), b"LAUNCH", b"\x80"], "unknown_op", "unknown op 'LAUNCH'"),
    ([rid(1), b"\xff\xfe", b"\x80"], "bad_frame", "ASCII"),
    ([rid(1), b"PING", b"\xc1"], "bad_request", "not valid msgpack"),
    ([rid(1), b"PING", msgpack.packb([1, 2])], "bad_request", "expected map"),
    ([rid(1), b"LOOKUP", msgpack.packb({"model": "m", "kv_world_size": 1})[:-3]],
     "bad_request", "not valid msgpack"),  # truncated
    ([rid(1), b"LOOKUP", b"\xc6\xff\xff\xff\xf0abc"],  # huge bin
     "bad_request", "not valid msgpack"),
    ([rid(1), b"LOOKUP", b"\xdd\xff\xff\xff\xff"],  # huge array
     "bad_request", "MAX_ITEMS_PER_MESSAGE"),
    ([rid(1), b"LOOKUP", msgpack.packb({"model": "m", "kv_world_size": "1", "items": []})],
     "bad_request", "`kv_world_size`: expected int, got str"),
    ([rid(1), b"LOOKUP", msgpack.packb({"model": "m", "kv_world_size": 1,
                                         "items": [{"request_id": "r", "chunk_hashes": [1]}]})],
     "bad_request", "`items[0].chunk_hashes`: expected bytes, got list"),
    ([rid(1), b"LOOKUP", msgpack.packb({"model": "m", "kv_world_size": 1, "items": [
        {"request_id": "r", "chunk_hashes": b"x" * 17}]})],
     "bad_request", "multiple of 16"),
    ([rid(1), b"HELLO", msgpack.packb({"protocol_version": 99})], "unsupported_version", "99"),
    ([rid(1), b"STORE", msgpack.packb({"instance_id": 424242, "items": []})],
     "unknown_instance", "424242"),
])
def test_bad_frames_get_error_replies(raw, frames, code, words):
    request_id, status, payload = exchange(raw, frames)
    assert status == b"err"
    assert payload["code"] == code
    assert words in payload["message"]
    assert request_id == (frames[0] if len(frames[0]) == 8 else rid(0))
    assert_still_serving(raw)


def test_oversized_message_is_dropped_and_the_server_keeps_serving():
    with run_server("--max-message-bytes", "1MiB") as server:
        # No reply comes: the client sees the connection go (ServerUnavailable), or its
        # timeout first (RequestTimeout).
        with CacheClient(server.url) as client, pytest.raises(TransportError):
            client.lookup(MODEL, 1, [LookupItem("r", b"\x00" * (2 * 1024**2))], timeout=1.0)
        # ZeroMQ drops the sender's connection: the server goes on serving everyone else.
        with CacheClient(server.url) as client:
            assert client.ping() > 0
            assert client.lookup(MODEL, 1, [LookupItem.build("r", prompt(1, 2))]) == [0]


def register(client, cache, **overrides):
    args = dict(model=MODEL, layout="mha", block_size=16)
    args.update(overrides)
    return client.register_kv_cache(cache.handles(), **args)


def test_bad_registrations_are_refused_with_the_reason(client):
    with make_cache(4 * BLOCKS_PER_CHUNK, None) as cache:
        good = cache.handles()[0]

        def variant(**changes):
            fields = dict(vars(good))
            fields.update(changes)
            return [MemfdHandle(**fields)]

        cases = [
            (variant(ticket=b"\x00" * 16), "unknown or expired ticket"),
            (variant(ticket=b"abc"), "expected 16 bytes from the fd channel"),
            (variant(offset=len(cache.layers) * 10**9), "holds"),
            (variant(shape=[2, 64, 16, 2]), "needs 5 dimensions"),
            (variant(dtype="complex64"), "unsupported 'complex64'"),
            (variant(strides=[-1, 1, 1, 1, 1]), "must not be negative"),
            (variant(shape=[3, 64, 16, 2, 64]), "MHA layers are [2, num_blocks"),
            (variant(offset=1), "multiple of the element size"),
            ([], "expected 1..1024 handles"),
        ]
        for handles, words in cases:
            with pytest.raises(BadRequest, match=None) as error:
                client.register_kv_cache(handles, model=MODEL, layout="mha", block_size=16)
            assert words in str(error.value), (handles, str(error.value))
        refusals: list[tuple[dict[str, Any], str]] = [
            ({"block_size": 32}, "differs from block_size"),
            ({"block_size": 48}, "divide the chunk size"),
            ({"layout": "gqa"}, "`layout`"),
            ({"kv_worker_id": 3}, "not in [0, 1)"),
            ({"model": ""}, "`model`")]
        for overrides, words in refusals:
            with pytest.raises(BadRequest) as error:
                register(client, cache, **overrides)
            assert words in str(error.value)
        with pytest.raises(ValueError, match="does not have open"):  # a local error
            client.register_kv_cache(variant(name="lmcache_mp_not_here"), model=MODEL,
                                     layout="mha", block_size=16)
        assert client.ping() > 0


def test_cuda_ipc_handles_are_refused_by_a_server_that_cannot_map_them(client):
    handle = CudaIpcHandle(b"\x00" * 64, 0, "GPU-58b8f8a1-0c3d-4e5f-8a9b-0123456789ab",
                           [64, 16, 576], [16 * 576, 576, 1], "bfloat16")
    expected = ("no GPU with UUID" if torch.cuda.is_available()
                else "`layers[0].kind`: this server has no CUDA, so it cannot map cuda_ipc handles")
    with pytest.raises(BadRequest, match=re.escape(expected)):
        client.register_kv_cache([handle], model=MODEL, layout="mla", block_size=16)
    assert client.ping() > 0


def test_a_bad_item_refuses_the_whole_batch(client):
    hashes = prompt(tag=50, num_chunks=2)
    with make_cache(4 * BLOCKS_PER_CHUNK, 3) as cache:
        registration = register(client, cache)
        good = TransferItem.build("good", hashes, chunk_blocks([0, 1]))
        bad_items = {
            "out of range": TransferItem.build("bad", prompt(51, 1), [0] * 15 + [64]),
            "negative": TransferItem.build("bad", prompt(51, 1), [-2] + [0] * 15),
            "count": TransferItem.build("bad", prompt(51, 1), [0] * 15),
            "salt": TransferItem.build("bad", prompt(51, 1), [0] * 16, cache_salt="has space"),
        }
        messages = {"out of range": "ids must be in [0, 64)", "negative": "got range [-2",
                    "count": "need 16 block ids", "salt": "cache_salt"}
        for reason, bad in bad_items.items():
            for call in (client.store, client.retrieve):
                with pytest.raises(BadRequest) as error:
                    call(registration, [good, bad])
                assert messages[reason] in str(error.value)
                assert "items[1]" in str(error.value)
        assert client.lookup(MODEL, 1, [LookupItem.build("x", hashes)]) == [0]
        assert client.stats().pending_stores == 0
        assert client.store(registration, [good]) == [bytes([StoreStatus.STORED] * 2)]
        client.unregister(registration)
        with pytest.raises(UnknownInstance):
            client.rpc.call(protocol.StoreRequest(registration.instance_id, [good]))


def test_a_bad_lookup_item_is_named_after_good_items_of_the_same_salt(client):
    """LOOKUP checks a salt once, and remembers up to MAX_VALID_SALTS_KEPT salts it found
    valid (emptied when full): every item is still checked, and the first bad one named."""
    many = [LookupItem.build(f"s{i}", prompt(80, 1), f"tenant-{i}")
            for i in range(MAX_VALID_SALTS_KEPT + 10)]
    for start in range(0, len(many), 512):  # fills the salts kept, and empties them
        batch = many[start:start + 512]
        assert client.lookup(MODEL, 1, batch) == [0] * len(batch)
    good = [LookupItem.build(f"ok{i}", prompt(60 + i, 2), "tenant-a") for i in range(3)]
    cases = {
        "cache_salt": LookupItem.build("bad", prompt(70, 1), "has space"),
        "request_id": LookupItem.build("r" * (protocol.MAX_REQUEST_ID_CHARS + 1),
                                       prompt(70, 1), "tenant-a"),
        "chunk_hashes": LookupItem("bad", b"\x00" * 17, "tenant-a"),
    }
    for field, bad in cases.items():
        with pytest.raises(BadRequest, match=rf"`items\[3\]\.{field}`"):
            client.lookup(MODEL, 1, [*good, bad])
    assert client.lookup(MODEL, 1, good) == [0, 0, 0]


def test_too_many_chunks_in_one_message_is_refused():
    with run_server("--max-chunks-per-message", "4") as server, CacheClient(server.url) as client:
        with pytest.raises(BadRequest, match="5 chunks in one message; the limit is 4"):
            client.lookup(MODEL, 1, [LookupItem.build("a", prompt(1, 3)),
                                     LookupItem.build("b", prompt(2, 2))])
        assert client.lookup(MODEL, 1, [LookupItem.build("a", prompt(1, 4))]) == [0]


def test_registrations_per_connection_are_bounded(server):
    with make_cache(BLOCKS_PER_CHUNK, None) as cache, CacheClient(server.url) as client, \
            CacheClient(server.url) as other:
        registrations = [register(client, cache)
                         for _ in range(MAX_REGISTRATIONS_PER_CONNECTION)]
        with pytest.raises(BadRequest, match="MAX_REGISTRATIONS_PER_CONNECTION"):
            register(client, cache)
        register(other, cache)  # another connection is not held back
        client.unregister(registrations.pop())
        registrations.append(register(client, cache))
        for registration in registrations:
            client.unregister(registration)
