"""The wire format on its own: every message round-trips, and bad payloads are named precisely."""

import dataclasses
import functools
import re
import typing
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from lmcache_mp import protocol
from lmcache_mp.errors import BadFrame, BadRequest, UnknownOp
from lmcache_mp.protocol import codec, messages

SCALARS = {int: 3, float: 1.5, str: "x", bool: True, bytes: b"\x01\x02"}


def sample_value(tp):
    """A non-default value of a field type."""
    origin = typing.get_origin(tp)
    if tp in SCALARS:
        return SCALARS[tp]
    if dataclasses.is_dataclass(tp):
        return sample(tp)
    if origin is list:
        return [sample_value(typing.get_args(tp)[0])]
    if origin is dict:
        return {"a": sample_value(typing.get_args(tp)[1])}
    options = [t for t in typing.get_args(tp) if t is not type(None)]  # X | None, or a tagged union
    return sample_value(options[0])


def sample(cls):
    """An instance of a message class with every field set to a non-default value."""
    hints = typing.get_type_hints(cls, vars(protocol))
    kwargs = {f.name: sample_value(hints[f.name]) for f in dataclasses.fields(cls)}
    if hasattr(cls, "KIND"):
        kwargs["kind"] = cls.KIND
    return cls(**kwargs)


@pytest.mark.parametrize("op", list(protocol.OPS))
def test_every_message_round_trips(op):
    for cls in (protocol.OPS[op].request, protocol.OPS[op].reply):
        message = sample(cls)
        assert protocol.unpack(cls, protocol.pack(message)) == message


@pytest.mark.parametrize("op", list(protocol.OPS) + ["error"])
def test_a_client_decodes_every_reply_as_the_general_decoder_does(op):
    cls = protocol.ErrorReply if op == "error" else protocol.OPS[op].reply
    message = sample(cls)
    assert protocol.unpack_reply(cls, protocol.pack(message)) == message
    newer = msgpack.packb({**msgpack.unpackb(protocol.pack(message)), "added_later": 1})
    assert protocol.unpack_reply(cls, newer) == message  # a newer server's field is ignored


def test_a_type_msgspec_cannot_build_decodes_through_the_general_decoder_every_time():
    cls = protocol.RegisterKVCacheRequest  # its handles are a tagged union of dataclasses
    message = sample(cls)
    for _ in range(2):  # the second from the decoder kept for it, not a refused Decoder
        assert protocol.unpack_reply(cls, protocol.pack(message)) == message
    decode = codec._MSGSPEC[cls]
    assert isinstance(decode, functools.partial) and decode.func is protocol.unpack


def test_no_message_needs_its_init_run():
    """msgspec builds messages (replies, requests on the fast path) without their __init__."""
    classes = [cls for cls in vars(messages).values()
               if isinstance(cls, type) and dataclasses.is_dataclass(cls)
               and cls.__module__ == messages.__name__]
    assert protocol.LookupItem in classes
    assert [cls for cls in classes if hasattr(cls, "__post_init__")] == []


def test_a_reply_msgspec_refuses_goes_to_the_general_decoder():
    assert protocol.unpack_reply(protocol.LookupReply, msgpack.packb({"hits": [2.0]})) \
        == protocol.LookupReply([2])
    with pytest.raises(BadRequest, match=r"`hits\[0\]`"):
        protocol.unpack_reply(protocol.LookupReply, msgpack.packb({"hits": ["x"]}))
    with pytest.raises(BadRequest, match="not valid msgpack"):
        protocol.unpack_reply(protocol.LookupReply, b"\xc1")


def test_errors_name_the_field():
    payload = protocol.pack(protocol.LookupRequest("m", 1, [protocol.LookupItem("r", b"")]))
    raw = msgpack.unpackb(payload)
    raw["items"][0]["chunk_hashes"] = [1, 2]
    with pytest.raises(BadRequest, match=r"`items\[0\].chunk_hashes`: expected bytes, got list"):
        protocol.unpack(protocol.LookupRequest, msgpack.packb(raw))
    del raw["model"]
    with pytest.raises(BadRequest, match="`model`: missing"):
        protocol.unpack(protocol.LookupRequest, msgpack.packb(raw))
    with pytest.raises(BadRequest, match="expected int, got bool"):
        protocol.unpack(protocol.UnregisterKVCacheRequest, msgpack.packb({"instance_id": True}))


def test_paths_are_named_deep_in_arrays_and_maps_for_the_first_wrong_value():
    """Paths are built only as an error leaves its arrays and maps: they must still name
    the first wrong value, at any depth, in both."""
    items = [protocol.LookupItem(f"r{i}", b"", "salt") for i in range(5)]
    raw = msgpack.unpackb(protocol.pack(protocol.LookupRequest("m", 1, items)))
    raw["items"][3]["cache_salt"] = 7
    raw["items"][4]["hold"] = "yes"
    with pytest.raises(BadRequest, match=r"^`items\[3\].cache_salt`: expected str, got int$"):
        protocol.unpack(protocol.LookupRequest, msgpack.packb(raw), bounded=True)
    with pytest.raises(BadRequest, match=r"^`items`: expected array, got str$"):
        protocol.unpack(protocol.LookupRequest, msgpack.packb({**raw, "items": "x"}))
    with pytest.raises(BadRequest, match=r"^payload: expected map, got list$"):
        protocol.unpack(protocol.LookupRequest, msgpack.packb([1]))
    stats = msgpack.unpackb(protocol.pack(sample(protocol.StatsReply)))
    stats["requests"] = {"LOOKUP": 1, "STORE": "many"}
    with pytest.raises(BadRequest, match=r"^`requests.STORE`: expected int, got str$"):
        protocol.unpack(protocol.StatsReply, msgpack.packb(stats))


def test_unknown_fields_are_ignored_and_defaults_fill_in():
    message = protocol.unpack(protocol.HelloRequest,
                              msgpack.packb({"protocol_version": 2, "from_the_future": [1]}))
    assert message == protocol.HelloRequest(2, client_name="", token="", engine="")


def test_version_2_hello():
    assert protocol.PROTOCOL_VERSION == 2
    assert [f.name for f in dataclasses.fields(protocol.HelloRequest)] == \
        ["protocol_version", "client_name", "token", "engine"]
    reply = protocol.unpack(protocol.HelloReply, protocol.pack(protocol.HelloReply(
        2, "0.1.0", 256, 1 << 26, 4096, 60.0, 30.0)))
    # A version 2 server always sends these; the defaults are what an engine session gets.
    assert (reply.role, reply.fd_socket, reply.max_items_per_message) == \
        (protocol.ROLE_ENGINE, "", protocol.MAX_ITEMS_PER_MESSAGE)
    assert protocol.ADMIN_OPS == {"CLEAR", "QUOTA_SET", "QUOTA_GET", "QUOTA_DELETE", "QUOTA_LIST"}
    assert protocol.ADMIN_OPS < set(protocol.OPS)
    assert {protocol.ROLE_ENGINE, protocol.ROLE_ADMIN} == {"engine", "admin"}


def test_limits_are_one_table():
    """Every module constant named in LIMITS has its value; the docs list the table."""
    for name, limit in protocol.LIMITS.items():
        assert getattr(protocol, name) == limit.value, name
        assert type(limit.value) is int and limit.value > 0 and limit.what, name
    assert protocol.MAX_INSTANCE_ID == 2**53 - 1
    assert protocol.LOOKUP_SLICE_PROBES < protocol.MAX_LOOKUP_PROBES
    assert (protocol.MAX_CHUNKS_PER_MESSAGE * protocol.MAX_KV_WORLD_SIZE
            >= protocol.MAX_LOOKUP_PROBES)


def test_integral_floats_are_accepted_for_int_fields():
    def decode(value):
        return protocol.unpack(protocol.UnregisterKVCacheRequest,
                               msgpack.packb({"instance_id": value})).instance_id
    assert decode(2.0) == 2 and type(decode(2.0)) is int
    assert decode(float(2**53)) == 2**53
    for bad in (2.5, float("nan"), float("inf"), float(2**53 + 2), True):
        with pytest.raises(BadRequest, match=r"`instance_id`: expected int"):
            decode(bad)
    # Floats stay floats, and ints are accepted for them.
    assert protocol.unpack(protocol.PingReply, msgpack.packb({"server_time": 3})).server_time == 3.0


def test_items_other_than_exact_scalars_are_converted_defaulted_or_named():
    """An item our clients would not send (an integral float for an int, defaults left out,
    an unknown field, a wrong type) leaves msgspec's fast path: it must decode, or fail, as
    the general decoder decides."""
    exact = {"request_id": "r", "chunk_hashes": b"h" * 16, "block_ids": b"\x01\0\0\0",
             "cache_salt": "s", "load_seq": 3, "parent_hash": b""}

    def items(*raws):
        return protocol.unpack(protocol.RetrieveRequest, msgpack.packb(
            {"instance_id": 1, "items": list(raws)}), bounded=True).items

    built = protocol.TransferItem("r", b"h" * 16, b"\x01\0\0\0", "s", 3, b"")
    assert items(exact, {**exact, "load_seq": 3.0}, {**exact, "newer_field": [1]}) == [built] * 3
    assert type(items({**exact, "load_seq": 3.0})[0].load_seq) is int
    short = {k: v for k, v in exact.items() if k not in ("cache_salt", "load_seq")}
    assert items(short) == [protocol.TransferItem("r", b"h" * 16, b"\x01\0\0\0")]
    for field, value, error in (("load_seq", True, "expected int, got bool"),
                                ("cache_salt", b"s", "expected str, got bytes"),
                                ("request_id", None, "expected str, got nil")):
        with pytest.raises(BadRequest, match=rf"^`items\[1\].{field}`: {error}$"):
            items(exact, {**exact, field: value})
    with pytest.raises(BadRequest, match=r"^`items\[0\].block_ids`: missing$"):
        items({k: v for k, v in exact.items() if k != "block_ids"})


def exact_decoder(cls: type) -> Callable[[bytes], Any]:
    decode = codec._exact_decoder(cls)
    assert decode is not None, f"no msgspec decoder for {cls.__name__}"
    return decode


def test_the_fast_path_takes_only_what_the_general_decoder_takes_as_it_is():
    """Requests as our clients encode them decode through msgspec; a payload that differs
    in any way (a duplicate key, a map over MAX_MAP_FIELDS, a string over
    MAX_STRING_BYTES) must meet the general rules."""
    for op in ("LOOKUP", "STORE", "RETRIEVE", "RELEASE", "END_SESSION", "HELLO"):
        message = sample(protocol.OPS[op].request)
        assert exact_decoder(type(message))(protocol.pack(message)) == message

    def lookup_map(entries):  # a map16 of these (key, value) pairs, duplicates and all
        return b"\xde" + len(entries).to_bytes(2, "big") + b"".join(
            msgpack.packb(k) + msgpack.packb(v, use_bin_type=True) for k, v in entries)

    fields = [("model", "m"), ("kv_world_size", 1), ("items", [])]
    reordered = lookup_map(fields[::-1])
    assert protocol.unpack(protocol.LookupRequest, reordered, bounded=True) == \
        protocol.LookupRequest("m", 1, [])
    twice = lookup_map([("model", "first"), *fields[1:], ("model", "last")])
    assert protocol.unpack(protocol.LookupRequest, twice, bounded=True).model == "last"
    wide = lookup_map(fields + [("model", "m")] * protocol.MAX_MAP_FIELDS)
    with pytest.raises(BadRequest, match="MAX_MAP_FIELDS"):
        protocol.unpack(protocol.LookupRequest, wide, bounded=True)
    model = "é" * (protocol.MAX_STRING_BYTES // 2 + 1)  # 2 bytes each: over MAX_STRING_BYTES
    payload = protocol.pack(protocol.LookupRequest(model, 1, []))
    with pytest.raises(BadRequest, match="MAX_STRING_BYTES"):
        protocol.unpack(protocol.LookupRequest, payload, bounded=True)


def test_an_unknown_field_nested_too_deep_for_msgspec_is_refused_by_msgpack():
    """msgspec skips an unknown field's value recursively, up to the interpreter's limit:
    past it, the general decoder answers, with msgpack's own depth limit."""
    deep = b"\x81\xa1k" * 100_000 + b"\xc0"
    fields = len(dataclasses.fields(protocol.LookupRequest))  # a fixmap of them and "k"
    payload = (bytes([0x80 | fields + 1]) + protocol.pack(protocol.LookupRequest("m", 1, []))[1:]
               + b"\xa1k" + deep)
    for decode in (lambda: protocol.unpack(protocol.LookupRequest, payload, bounded=True),
                   lambda: protocol.unpack_reply(protocol.LookupRequest, payload)):
        with pytest.raises(BadRequest, match="nested more than 1024 deep"):
            decode()


def test_only_messages_whose_bounds_keep_the_limits_take_the_fast_path():
    """msgspec counts neither a string's bytes nor a payload's values: a class takes the
    fast path only if its declared bounds keep every payload of it within the LIMITS."""
    assert codec._exact_decoder(protocol.LookupReply) is None  # `hits` declares no length
    assert codec._exact_decoder(protocol.RegisterKVCacheRequest) is None  # a tagged union
    assert codec._exact_decoder(protocol.ClearRequest) is None  # `Salt | None`

    @dataclasses.dataclass
    class Labelled:
        label: str  # no declared length

    @dataclasses.dataclass
    class Inner:
        values: protocol.Items[int]

    @dataclasses.dataclass
    class Outer:
        items: protocol.Items[Inner]  # up to MAX_ITEMS_PER_MESSAGE² values, none counted

    @dataclasses.dataclass
    class Leases:
        items: protocol.Items[protocol.LeaseRef]

    assert codec._exact_decoder(Labelled) is None and codec._exact_decoder(Outer) is None
    assert codec._exact_decoder(Inner) is None  # arrays are of messages only
    assert codec._exact_decoder(Leases) is not None


# A salt too long is refused as one with a wrong character: its first 40 characters quoted.
SALT_257 = ("cache_salt must be at most 256 printable ASCII characters without spaces, got "
            f"{'s' * 40!r}")


def test_each_field_is_held_to_its_declared_bounds_on_both_paths():
    """A bound declared on a field refuses a value, whether our client sent it (msgspec's
    fast path) or another encoder did (the general decoder), with one message that names
    the field."""
    item = protocol.TransferItem("r", b"", b"")
    register = sample(protocol.RegisterKVCacheRequest)
    memfd = sample(protocol.MemfdHandle)
    cases = [
        (protocol.LookupRequest("", 1, []), "`model`: expected 1..512 characters, got 0"),
        (protocol.LookupRequest("m" * 513, 1, []),
         "`model`: expected 1..512 characters, got 513"),
        (protocol.LookupRequest("m", 0, []), "`kv_world_size`: must be in [1, 1024], got 0"),
        (protocol.LookupRequest("m", 1025, []),
         "`kv_world_size`: must be in [1, 1024], got 1025"),
        (protocol.LookupRequest("m", 1, [protocol.LookupItem("r" * 513, b"")]),
         "`items[0].request_id`: at most 512 characters, got 513"),
        (protocol.LookupRequest("m", 1, [protocol.LookupItem("r", b"", "s" * 257)]),
         f"`items[0].cache_salt`: {SALT_257}"),
        (protocol.StoreRequest(1, [item], budget_ms=protocol.MAX_BUDGET_MS + 1),
         "`budget_ms`: must be in [0, 3600000], got 3600001"),
        (protocol.RetrieveRequest(1, [item], budget_ms=-1),
         "`budget_ms`: must be in [0, 3600000], got -1"),
        (protocol.RetrieveRequest(1, [item, dataclasses.replace(item, load_seq=-1)]),
         "`items[1].load_seq`: must be in [0, 9007199254740991], got -1"),
        (protocol.RetrieveRequest(1, [], progress_tag=2**53),
         "`progress_tag`: must be in [0, 9007199254740991], got 9007199254740992"),
        (protocol.ReleaseRequest([protocol.LeaseRef("r" * 513)]),
         "`items[0].request_id`: at most 512 characters, got 513"),
        (protocol.EndSessionRequest("r", "s" * 257), f"`cache_salt`: {SALT_257}"),
        (protocol.HelloRequest(2, engine="e" * 257), "`engine`: at most 256 characters, got 257"),
        (protocol.ClearRequest("s" * 257), f"`cache_salt`: {SALT_257}"),
        (protocol.QuotaSetRequest("s" * 257, None), f"`cache_salt`: {SALT_257}"),
        (dataclasses.replace(register, layers=[]), "`layers`: expected 1..1024 handles, got 0"),
        (dataclasses.replace(register, tp_rank=1024), "`tp_rank`: must be in [0, 1023], got 1024"),
        (dataclasses.replace(register, tp_group="g" * 257), "`tp_group`: at most 256 characters"),
        (dataclasses.replace(register, model=""), "`model`: expected 1..512 characters, got 0"),
        (dataclasses.replace(register, layers=[memfd, dataclasses.replace(memfd, name="n" * 257)]),
         "`layers[1].name`: at most 256 characters, got 257"),
    ]
    for message, error in cases:
        payload = protocol.pack(message)
        newer = msgpack.packb({**msgpack.unpackb(payload), "added_later": 1})  # general path
        for sent in (payload, newer):
            with pytest.raises(BadRequest, match=f"^{re.escape(error)}"):
                protocol.unpack(type(message), sent, bounded=True)
    at_the_bounds = protocol.LookupRequest("m" * 512, 1024, [protocol.LookupItem("r" * 512, b"",
                                                                                  "s" * 256)])
    payload = protocol.pack(at_the_bounds)
    assert exact_decoder(protocol.LookupRequest)(payload) == at_the_bounds
    assert protocol.unpack(protocol.LookupRequest, payload, bounded=True) == at_the_bounds


def test_bounded_decoding_refuses_oversized_containers_before_building_them():
    lookup = {"model": "m", "kv_world_size": 1, "items": []}
    items = [{"request_id": "r", "chunk_hashes": b""}]
    ok = dict(lookup, items=items * protocol.MAX_ITEMS_PER_MESSAGE)
    assert len(protocol.unpack(protocol.LookupRequest, msgpack.packb(ok), bounded=True).items) \
        == protocol.MAX_ITEMS_PER_MESSAGE
    too_many = dict(lookup, items=items * (protocol.MAX_ITEMS_PER_MESSAGE + 1))
    wide = dict(lookup, **{f"k{i}": 0 for i in range(protocol.MAX_MAP_FIELDS)})
    long = dict(lookup, model="m" * (protocol.MAX_STRING_BYTES + 1))
    for payload, bound in ((too_many, "an array of 1025 elements, more than "
                                      "MAX_ITEMS_PER_MESSAGE"),
                           (wide, "a map of 67 keys, more than MAX_MAP_FIELDS"),
                           (long, "a string of 4097 bytes, more than MAX_STRING_BYTES")):
        packed = msgpack.packb(payload)
        with pytest.raises(BadRequest, match=rf"payload holds {bound} allows"):
            protocol.unpack(protocol.LookupRequest, packed, bounded=True)
    # Unbounded: the client's replies, whose fields declare no bounds.
    many = [0] * (protocol.MAX_ITEMS_PER_MESSAGE + 1)
    hits = msgpack.packb({"hits": many, **{f"k{i}": 0 for i in range(protocol.MAX_MAP_FIELDS)}})
    assert protocol.unpack(protocol.LookupReply, hits) == protocol.LookupReply(many)
    error = protocol.ErrorReply("internal", "m" * (protocol.MAX_STRING_BYTES + 1))
    assert protocol.unpack(protocol.ErrorReply, protocol.pack(error)) == error
    with pytest.raises(BadRequest, match="not valid msgpack"):
        protocol.unpack(protocol.LookupRequest, msgpack.packb(msgpack.ExtType(1, b"x")),
                        bounded=True)


def test_unsupported_handle_kind_is_named():
    raw = dataclasses.asdict(sample(protocol.RegisterKVCacheRequest))
    raw["layers"][0]["kind"] = "nvlink"
    with pytest.raises(BadRequest, match=r"`layers\[0\].kind`: unsupported handle kind 'nvlink'; "
                                         r"this server supports 'memfd', 'cuda_ipc'"):
        protocol.unpack(protocol.RegisterKVCacheRequest, msgpack.packb(raw))
    raw["layers"][0]["kind"] = "shm"  # version 1's handles by name are gone
    with pytest.raises(BadRequest, match=r"unsupported handle kind 'shm'"):
        protocol.unpack(protocol.RegisterKVCacheRequest, msgpack.packb(raw))
    raw["layers"][0]["kind"] = 7
    with pytest.raises(BadRequest, match=r"`layers\[0\].kind`: unsupported handle kind 7"):
        protocol.unpack(protocol.RegisterKVCacheRequest, msgpack.packb(raw))


def test_handles_are_a_tagged_union_and_cuda_ipc_fields_are_named():
    cuda = sample(protocol.CudaIpcHandle)
    memfd = sample(protocol.MemfdHandle)
    request = dataclasses.replace(sample(protocol.RegisterKVCacheRequest), layers=[cuda, memfd])
    decoded = protocol.unpack(protocol.RegisterKVCacheRequest, protocol.pack(request))
    assert decoded == request
    assert [type(h) for h in decoded.layers] == [protocol.CudaIpcHandle, protocol.MemfdHandle]
    raw = msgpack.unpackb(protocol.pack(request))
    del raw["layers"][1]["kind"]  # no kind: memfd
    assert protocol.unpack(protocol.RegisterKVCacheRequest, msgpack.packb(raw)).layers[1] == memfd
    del raw["layers"][1]["name"]  # a label only: it may be left out
    assert protocol.unpack(protocol.RegisterKVCacheRequest,
                           msgpack.packb(raw)).layers[1] == dataclasses.replace(memfd, name="")
    raw["layers"][1]["ticket"] = "not bytes"
    with pytest.raises(BadRequest, match=r"`layers\[1\].ticket`: expected bytes, got str"):
        protocol.unpack(protocol.RegisterKVCacheRequest, msgpack.packb(raw))
    raw["layers"][1]["ticket"] = memfd.ticket
    raw["layers"][0]["ipc_handle"] = "not bytes"
    with pytest.raises(BadRequest, match=r"`layers\[0\].ipc_handle`: expected bytes, got str"):
        protocol.unpack(protocol.RegisterKVCacheRequest, msgpack.packb(raw))
    raw["layers"][0]["ipc_handle"] = cuda.ipc_handle
    del raw["layers"][0]["device_uuid"]
    with pytest.raises(BadRequest, match=r"`layers\[0\].device_uuid`: missing"):
        protocol.unpack(protocol.RegisterKVCacheRequest, msgpack.packb(raw))
    raw["layers"][0] = [1]
    with pytest.raises(BadRequest, match=r"`layers\[0\]`: expected map, got list"):
        protocol.unpack(protocol.RegisterKVCacheRequest, msgpack.packb(raw))


@pytest.mark.parametrize("payload", [b"\xc1", b"\x92\x01", b"\xdb\xff\xff\xff\xff", b""])
def test_invalid_or_truncated_msgpack_is_a_bad_request(payload):
    with pytest.raises(BadRequest, match="not valid msgpack"):
        protocol.unpack(protocol.PingRequest, payload)


def ping_reply(server_time: Any) -> protocol.PingReply:
    """A PingReply around any value, though the dataclass says float: what pack() meets."""
    return protocol.PingReply(server_time)


def test_only_message_instances_are_packed():
    @dataclasses.dataclass
    class Nested:
        note: str

    assert msgpack.unpackb(protocol.pack(ping_reply(Nested("x")))) == {
        "server_time": {"note": "x"}}
    # msgspec writes a set as an array (msgpack-python refused it): pinned, not hidden.
    assert msgpack.unpackb(protocol.pack(ping_reply({1, 2}))) == {"server_time": [1, 2]}
    for value in (object(), protocol.LookupItem, 1j):  # a message class is not a message
        with pytest.raises(TypeError, match=f"cannot send a {type(value).__name__} on the wire"):
            protocol.pack(ping_reply(value))


def test_frames():
    frames = [protocol.encode_request_id(7), b"PING", protocol.pack(protocol.PingRequest())]
    parsed = protocol.parse_request_frames(frames)
    assert (parsed.request_id, parsed.op) == (7, "PING")
    with pytest.raises(BadFrame, match="3 frames"):
        protocol.parse_request_frames(frames[:2])
    with pytest.raises(BadFrame, match="8 bytes"):
        protocol.parse_request_frames([b"\x01", b"PING", b"\x80"])
    with pytest.raises(UnknownOp, match="FLY"):
        protocol.parse_request_frames([protocol.encode_request_id(1), b"FLY", b"\x80"])
    with pytest.raises(BadFrame, match="ASCII"):
        protocol.parse_request_frames([protocol.encode_request_id(1), b"\xff", b"\x80"])


def test_packed_arrays():
    hashes = [bytes([i]) * 16 for i in range(3)]
    assert protocol.unpack_hashes(protocol.pack_hashes(hashes), "h") == hashes
    assert protocol.unpack_block_ids(protocol.pack_block_ids([0, 5, -1, 2**31 - 1]), "b") == [
        0, 5, -1, 2**31 - 1]
    with pytest.raises(BadRequest, match="multiple of 16"):
        protocol.unpack_hashes(b"\x00" * 17, "items[0].chunk_hashes")
    with pytest.raises(BadRequest, match="multiple of 4"):
        protocol.unpack_block_ids(b"\x00" * 6, "items[0].block_ids")


@pytest.mark.parametrize("count", [0, 1, 8, 1024, 1025, 3000])
def test_split_hashes_keeps_every_byte(count):
    """Any count, on both sides of the C path's limit; NUL bytes at either end stay."""
    hashes = [bytes([0]) + i.to_bytes(14, "big") + bytes([i % 2]) for i in range(count)]
    assert list(protocol.split_hashes(protocol.pack_hashes(hashes))) == hashes
