"""Fuzz the wire protocol against one real server, with a well-behaved client alongside.

A raw DEALER sends hypothesis-made frames, payloads and msgpack garbage. Every message must
get exactly one reply with the request id that docs/protocol.md promises (the message's own
8-byte id, else 0), an `err` reply must carry a known code and a message, never `internal`,
and nothing the fuzzer sends may reach the bystander: its registrations belong to its
connection, its chunks (in a salt with a reservation) stay byte for byte, and the server
never dies, never leaves a store pending and leaks no descriptors.

LMCACHE_MP_FUZZ_EXAMPLES (default 2000) is the example budget of the whole file, split
over the @given tests below.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import random
import struct
import tempfile
import time
import types
import typing
import uuid
from dataclasses import dataclass, replace
from typing import Any, Union

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from lmcache_mp import protocol
from lmcache_mp.client import SharedKVCache, StoreStatus, TransferItem
from lmcache_mp.errors import ERROR_CLASSES
from lmcache_mp.fdpass import send_fds
from lmcache_mp.protocol import (
    ADMIN_OPS,
    MAX_CHUNKS_PER_MESSAGE,
    MAX_ITEMS_PER_MESSAGE,
    MAX_LAYERS,
    MAX_LOOKUP_PROBES,
    MAX_MAP_FIELDS,
    MAX_MESSAGE_BYTES,
    MAX_STRING_BYTES,
    OPS,
    PROTOCOL_VERSION,
    ErrorReply,
    HelloRequest,
    RegisterKVCacheRequest,
    RetrieveRequest,
    TensorHandle,
)

from ..utils import rid, run_server
from ..workers import BLOCKS_PER_CHUNK, MODEL, chunk_blocks, make_cache

# Hypothesis keeps caches (unicode tables, constants) even without an example database: in
# the temporary directory, never in the repository.
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(),
                                     f"lmcache-mp-hypothesis-{os.getuid()}"))

pytestmark = [pytest.mark.slow,
              # Examples near the limits are large; hypothesis warns before printing one.
              pytest.mark.filterwarnings("ignore:Generating overly large repr")]

FUZZ_EXAMPLES = int(os.environ.get("LMCACHE_MP_FUZZ_EXAMPLES", "2000"))
REPLY_TIMEOUT_S = 60.0  # every reply awaited must come: the bound only ends a hang
CHECK_EVERY = 100  # examples between two checks of the bystander
FD_SLACK = 8  # descriptors the server may hold beyond its count after set-up

BYSTANDER_SALT = "bystander"
BYSTANDER_BLOCKS = 4 * BLOCKS_PER_CHUNK
BYSTANDER_SOURCE = chunk_blocks([0, 1, 2, 3])
BYSTANDER_TARGET = chunk_blocks([3, 1, 0, 2])

# The fuzzer's own KV cache: MHA, 2 layers of [2, 64 blocks, 16 tokens, 1 head, 8] bytes,
# so 16 blocks and 8 KiB per chunk; its STOREs reach the copy paths.
FUZZ_MODEL = "fuzz-model"
FUZZ_BLOCK_SIZE = 16
FUZZ_BLOCKS = 64
FUZZ_BLOCKS_PER_CHUNK = 256 // FUZZ_BLOCK_SIZE
HASH_POOL = [bytes([i]) * 16 for i in range(1, 9)]  # shared by the fuzzer's stores and lookups

ZERO_ID = struct.pack("<Q", 0)


def fuzz_settings(share: float) -> settings:
    return settings(max_examples=max(1, int(FUZZ_EXAMPLES * share)), deadline=None,
                    derandomize=False, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


# ---------------------------------------------------------------------------
# Values known only at run time: the instance ids of the fuzzer's and the bystander's
# caches, and a fresh fd channel ticket for the fuzzer's memfd.

@dataclass(frozen=True)
class Ref:
    whose: str  # "own", "bystander" or "ticket"
    as_float: bool = False  # integral floats are accepted for ints: try that route too


def resolve(value: Any, ids: dict[str, Any]) -> Any:
    if isinstance(value, Ref):
        n = ids[value.whose]
        return float(n) if value.as_float else n
    if isinstance(value, dict):
        return {k: resolve(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, ids) for v in value]
    return value


# ---------------------------------------------------------------------------
# Strategies: scalars at their edges, and wrongly typed values.

def weighted(*pairs: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    table = [s for weight, s in pairs for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


def random_bytes(length: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(length)


INT_EDGES = [0, 1, -1, 2, 3, 15, 16, 17, 63, 64, 65, 255, 256, 1023, 1024, 1025, 4095, 4096,
             4097, 2**31 - 1, 2**31, -2**31, 2**32, 2**53 - 1, 2**53, 2**53 + 1, 2**63 - 1,
             -2**63, 2**64 - 1]
INTEGRAL_FLOATS = [0.0, -0.0, 1.0, 2.0, 16.0, 256.0, 2.0**31, 2.0**53 - 1, 2.0**53, 2.0**53 + 2,
                   2.0**63, 2.0**64, -1.0, 1e300]
ODD_FLOATS = [0.5, -0.5, math.nan, math.inf, -math.inf, 5e-324]
LENGTH_EDGES = [0, 1, 15, 16, 17, 255, 256, 257, 511, 512, 513, 4095, 4096, 4097]
BYTE_EDGES = [0, 1, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65,
              MAX_CHUNKS_PER_MESSAGE * 16 - 16, MAX_CHUNKS_PER_MESSAGE * 16,
              MAX_CHUNKS_PER_MESSAGE * 16 + 4, MAX_CHUNKS_PER_MESSAGE * 16 + 16]

ints = weighted((3, st.sampled_from(INT_EDGES)), (1, st.integers(-2**63, 2**64 - 1)),
                (1, st.sampled_from(INTEGRAL_FLOATS)), (1, st.sampled_from(ODD_FLOATS)))
floats = st.one_of(st.floats(), st.sampled_from(INT_EDGES))
texts = weighted(
    (3, st.text(max_size=12)),
    (2, st.sampled_from(LENGTH_EDGES).map(lambda n: "x" * n)),
    # 4096 and 4098 UTF-8 bytes: msgpack's limit counts bytes, not characters
    (1, st.sampled_from(["\u00e9" * 2048, "\u00e9" * 2049, "\x00", " ", "a b", "\U0001f600"])))
binaries = weighted(
    (3, st.binary(max_size=40)),
    (2, st.builds(random_bytes, st.sampled_from(BYTE_EDGES), st.integers(0, 2**16))))
wrong = st.one_of(
    st.none(), st.booleans(), st.just({}), st.just([]), st.just({"a": [1, {"b": None}]}),
    st.just([[[]]]), st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-2**63, 2**64 - 1), max_size=2),
    st.text(max_size=4), st.binary(max_size=4), st.sampled_from(ODD_FLOATS),
    st.sampled_from(INT_EDGES))

salts = weighted((6, st.sampled_from(["", "fuzz", "fuzz-2", BYSTANDER_SALT, "x" * 256])),
                 (1, st.sampled_from(["has space", "\u00e9", "x" * 257, "\x7f", "\x00"])))
request_ids = weighted((4, st.sampled_from(["r0", "r1", "r2", "r3"])),
                       (1, st.sampled_from(["", "x" * 512, "x" * 513])),
                       (1, st.text(max_size=8)))
models = weighted((4, st.just(FUZZ_MODEL)), (1, st.just(MODEL)), (1, texts))
world_sizes = weighted((4, st.just(1)), (2, st.sampled_from([2, 63, 64, 65, 1024, 1025, 0, -1,
                                                             64.0])), (1, ints))
small_ints = weighted((4, st.sampled_from([0, 0, 1, 2, -1, 1023, 1024])), (1, ints))
instance_ids = weighted(
    (6, st.just(Ref("own"))), (1, st.just(Ref("own", as_float=True))),
    (2, st.just(Ref("bystander"))), (1, st.just(Ref("bystander", as_float=True))),
    (1, ints))
few_chunks = st.integers(0, 4)
chunk_counts = weighted((8, few_chunks),
                        (1, st.sampled_from([255, 256, 1024, MAX_CHUNKS_PER_MESSAGE,
                                             MAX_CHUNKS_PER_MESSAGE + 1])))


def hashes_of(n: int, seed: int) -> bytes:
    rng = random.Random(seed)
    return b"".join(rng.choice(HASH_POOL) for _ in range(n))


chunk_hashes = weighted((4, st.builds(hashes_of, chunk_counts, st.integers(0, 2**16))),
                        (1, binaries))


@st.composite
def block_ids_for(draw, n_chunks: int, raw: st.SearchStrategy = binaries) -> bytes:
    """Block ids for n chunks of the fuzzer's cache: right, or wrong in one of many ways."""
    rng = random.Random(draw(st.integers(0, 2**16)))
    ids = [rng.randrange(FUZZ_BLOCKS) for _ in range(n_chunks * FUZZ_BLOCKS_PER_CHUNK)]
    how = draw(st.sampled_from(["good"] * 6 + ["skip", "edge", "short", "long", "raw"]))
    if how == "raw":
        return draw(raw)
    if ids and how in ("skip", "edge"):
        value = -1 if how == "skip" else draw(st.sampled_from(
            [FUZZ_BLOCKS - 1, FUZZ_BLOCKS, -2, 2**31 - 1, -2**31]))
        ids[rng.randrange(len(ids))] = value
    elif how == "short":
        ids = ids[:-1]
    elif how == "long":
        ids.append(0)
    packed = struct.pack(f"<{len(ids)}i", *ids)
    if draw(st.integers(0, 15)) == 0:
        packed += b"\x00" * draw(st.integers(1, 3))  # not a multiple of 4
    return packed


@st.composite
def transfer_items(draw, counts: st.SearchStrategy = chunk_counts) -> dict:
    n = draw(counts)
    raw = binaries if counts is chunk_counts else st.binary(max_size=40)  # copies stay small
    return {"request_id": draw(request_ids), "chunk_hashes": hashes_of(n, draw(st.integers())),
            "block_ids": draw(block_ids_for(n, raw)), "cache_salt": draw(salts)}


@st.composite
def lookup_items(draw, hashes: st.SearchStrategy = chunk_hashes) -> dict:
    return {"request_id": draw(request_ids), "chunk_hashes": draw(hashes),
            "cache_salt": draw(salts), "hold": draw(st.booleans())}


lease_refs = st.fixed_dictionaries({"request_id": request_ids, "cache_salt": salts})


@st.composite
def item_lists(draw, items: st.SearchStrategy, small: st.SearchStrategy | None = None) -> list:
    """A few items, or as many as the limit allows (and one more), made by copying one
    (`small`, if given: the copies must stay far below MAX_MESSAGE_BYTES in all)."""
    if draw(st.integers(0, 9)):
        return draw(st.lists(items, max_size=3))
    one = draw(items if small is None else small)
    count = draw(st.sampled_from([MAX_ITEMS_PER_MESSAGE - 1, MAX_ITEMS_PER_MESSAGE,
                                  MAX_ITEMS_PER_MESSAGE + 1]))
    return [dict(one, request_id=f"r{i}") if "request_id" in one else one for i in range(count)]


@st.composite
def lookup_item_lists(draw) -> list:
    """Also lookups whose chunks times kv_world_size come near MAX_LOOKUP_PROBES."""
    if draw(st.integers(0, 9)):
        return draw(item_lists(lookup_items(), lookup_items(st.builds(
            hashes_of, few_chunks, st.integers(0, 2**16)))))
    per_item = draw(st.sampled_from([MAX_CHUNKS_PER_MESSAGE // 2, MAX_CHUNKS_PER_MESSAGE // 4]))
    count = MAX_CHUNKS_PER_MESSAGE // per_item + draw(st.sampled_from([0, 0, 1]))
    seed = draw(st.integers(0, 2**16))
    return [{"request_id": f"r{i}", "chunk_hashes": hashes_of(per_item, seed + i),
             "cache_salt": "fuzz", "hold": draw(st.booleans())} for i in range(count)]


# Shapes and strides of the fuzzer's uint8 layers ([2, 64, 16, 1, 8] in MHA, [64, 16, 8] in
# MLA), and of layers that alias their memory or whose element counts overflow int64.
GOOD_SHAPES = [[2, FUZZ_BLOCKS, FUZZ_BLOCK_SIZE, 1, 8], [FUZZ_BLOCKS, FUZZ_BLOCK_SIZE, 8]]
ODD_SHAPES = [[2, 2**40, 16, 1, 8], [2, 2**62, 16, 1, 8], [2, 2**64 - 1, 16, 1, 8],
              [2, 64, 16, 1, 2**62], [2, 0, 16, 1, 8], [2, -1, 16, 1, 8], []]
GOOD_STRIDES = [[FUZZ_BLOCKS * FUZZ_BLOCK_SIZE * 8, FUZZ_BLOCK_SIZE * 8, 8, 8, 1],
                [FUZZ_BLOCK_SIZE * 8, 8, 1]]
ODD_STRIDES = [[0, 0, 0, 0, 0], [0, 0, 0], [8192, 128, 8, 2**64 - 1, 1],
               [8192, 128, 8, 2**63, 1], [1, 1, 1, 1, 1], [2**62, 0, 0, 0, 0], [-1, 1, 1, 1, 1]]


def shape_lists(good: list, odd: list) -> st.SearchStrategy:
    return weighted((4, st.sampled_from(good)), (2, st.sampled_from(odd)),
                    (1, st.lists(small_ints, max_size=6)))


handle_overrides: dict[str, st.SearchStrategy] = {
    # Ref("ticket"): a real ticket for the fuzzer's memfd, so that registrations get past
    # the fd channel to the checks of the memory the layers span.
    "ticket": weighted((4, st.just(Ref("ticket"))),
                       (2, st.builds(random_bytes, st.just(16), st.integers())),
                       (1, st.sampled_from([b"", b"\x00" * 16, b"x" * 15, b"x" * 17]))),
    "ipc_handle": st.builds(random_bytes, st.sampled_from([64, 64, 63, 0]), st.integers()),
    "offset": weighted((3, st.sampled_from([0, 0, 16384, 8, 1, 32767, 32768, -1, 2**62])),
                       (1, ints)),
    "shape": shape_lists(GOOD_SHAPES, ODD_SHAPES),
    "strides": shape_lists(GOOD_STRIDES, ODD_STRIDES),
    "dtype": weighted((3, st.just("uint8")),
                      (1, st.sampled_from(["float16", "bfloat16", "float8_e4m3fn", "int64",
                                           "", "torch.float16", "bool"]))),
    "kind": weighted((6, st.just("memfd")),
                     (1, st.sampled_from(["cuda_ipc", "shm", "", "MEMFD"]))),
    "device_uuid": st.sampled_from(["", "GPU-00000000-0000-0000-0000-000000000000", "x" * 300]),
}

# Good values per field, where the field's name says more than its type.
FIELD_OVERRIDES: dict[str, st.SearchStrategy] = {
    "protocol_version": weighted((4, st.just(PROTOCOL_VERSION)),
                                 (1, st.sampled_from([1, 0, 3, -1, 2**64 - 1, 2.0, 2.5]))),
    "token": weighted((4, st.just("")), (1, texts)),
    "engine": weighted((2, st.just("")), (1, st.sampled_from(["fuzz-engine", "x" * 257])),
                       (1, texts)),
    "client_name": weighted((2, st.just("fuzzer")), (1, texts)),
    "model": models,
    "kv_world_size": world_sizes,
    "kv_worker_id": weighted((5, st.just(0)), (1, small_ints)),
    "tp_rank": weighted((5, st.just(0)), (1, small_ints)),
    "layout": st.sampled_from(["mha", "mha", "mla", "", "MHA", "gqa"]),
    "block_size": st.sampled_from([FUZZ_BLOCK_SIZE, FUZZ_BLOCK_SIZE, 1, 3, 0, -16, 256, 512,
                                   2**63 - 1]),
    "tp_group": texts,
    "store_event": st.sampled_from([b"", b"", b"\x00" * 64, b"\x00" * 63]),
    "instance_id": instance_ids,
    "request_id": request_ids,
    "cache_salt": salts,
    "chunk_hashes": chunk_hashes,
    "hold": st.booleans(),
    "cap": st.one_of(st.none(), ints),
    "reserve": ints,
    **handle_overrides,
}


def _typed(tp: Any) -> st.SearchStrategy:
    """Well-typed values for a type annotation of the protocol module."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = [o for o in typing.get_args(tp) if o is not type(None)]
        inner = st.one_of([message_maps(o) if isinstance(o, type) and dataclasses.is_dataclass(o)
                           else _typed(o) for o in options])
        return inner if len(options) == len(typing.get_args(tp)) else st.none() | inner
    if origin is list:
        (item,) = typing.get_args(tp)
        return item_lists(_typed(item))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return message_maps(tp)
    return {int: ints, float: floats, str: texts, bytes: binaries, bool: st.booleans()}[tp]


def _field_strategy(cls: type, name: str, tp: Any) -> st.SearchStrategy:
    if name == "items":
        return {protocol.LookupRequest: lookup_item_lists(),
                protocol.StoreRequest: item_lists(transfer_items(), transfer_items(few_chunks)),
                protocol.RetrieveRequest: item_lists(transfer_items(),
                                                     transfer_items(few_chunks)),
                protocol.ReleaseRequest: item_lists(lease_refs)}[cls]
    if name == "layers":
        return layer_lists()
    if name in FIELD_OVERRIDES:
        return FIELD_OVERRIDES[name]
    return _typed(tp)


@st.composite
def layer_lists(draw) -> list:
    """Layers as an engine lays them out (one handle, copied at a distance in one memfd),
    sometimes with one layer unlike the others, sometimes each its own."""
    handles = weighted((5, message_maps(protocol.MemfdHandle)),
                       (1, message_maps(protocol.CudaIpcHandle)))
    if draw(st.integers(0, 5)) == 0:
        return draw(weighted((3, st.lists(handles, min_size=1, max_size=3)),
                             (1, item_lists(handles))))
    first = draw(handles)
    count = draw(st.sampled_from([1, 2, 2, 2, 3, MAX_LAYERS, MAX_LAYERS + 1]))
    step = draw(st.sampled_from([16384, 16384, 0, 8192, 1, -16384]))
    base = first.get("offset", 0)
    layers = [dict(first, offset=min(max(base + i * step, -2**63), 2**64 - 1))
              if isinstance(base, int) else first for i in range(count)]
    if count > 1 and draw(st.integers(0, 3)) == 0:
        layers[draw(st.integers(0, count - 1))] = draw(handles)
    return layers


_MAPS: dict[type, st.SearchStrategy] = {}


def message_maps(cls: type) -> st.SearchStrategy:
    """Maps built from a request dataclass's fields: mostly well typed, with a few mutations
    (a field missing, wrongly typed, named by a bin key) and unknown keys, up to the limit."""
    if cls not in _MAPS:
        hints = typing.get_type_hints(cls, vars(protocol))
        names = [f.name for f in dataclasses.fields(cls)]

        def deferred(n: str) -> st.SearchStrategy:
            return st.deferred(lambda: _field_strategy(cls, n, hints[n]))
        strategies = {n: deferred(n) for n in names}

        @st.composite
        def build(draw) -> dict:
            value = {n: draw(strategies[n]) for n in names}
            mutations = draw(st.sampled_from([0] * 6 + [1, 1, 2])) if names else 0
            for name in draw(st.lists(st.sampled_from(names), min_size=mutations,
                                      max_size=mutations)) if mutations else []:
                how = draw(st.sampled_from(["drop", "wrong", "wrong", "bin_key"]))
                if name not in value:
                    continue
                if how == "drop":
                    del value[name]
                elif how == "wrong":
                    value[name] = draw(wrong)
                else:
                    value[name.encode()] = value.pop(name)
            extra = draw(st.sampled_from([0] * 8 + [1, 2, MAX_MAP_FIELDS - len(value),
                                                    MAX_MAP_FIELDS + 1 - len(value)]))
            for i in range(max(0, extra)):
                value[f"unknown_{i}"] = i
            return value
        _MAPS[cls] = build()
    return _MAPS[cls]


@st.composite
def op_payloads(draw, op: str | None = None) -> tuple[str, dict]:
    op = op or draw(st.sampled_from(sorted(OPS)))
    return op, draw(message_maps(OPS[op].request))


DIMENSION_EDGES = [0, 1, 2, 7, 8, 15, 16, 17, 63, 64, 65, 128, 8192, 2**31, 2**62, 2**63 - 1,
                   2**63, 2**64 - 1, -1]


@st.composite
def registrations(draw) -> dict:
    """REGISTER_KV_CACHE of the fuzzer's memfd with a real ticket, right but for the layers'
    geometry: shapes, strides, offsets, counts, dtypes and block sizes near and past the
    edges, which the server must check before it maps and views the memory."""
    layout = draw(st.sampled_from(["mha", "mha", "mha", "mla"]))
    shape, strides = ((list(GOOD_SHAPES[0]), list(GOOD_STRIDES[0])) if layout == "mha"
                      else (list(GOOD_SHAPES[1]), list(GOOD_STRIDES[1])))
    for _ in range(draw(st.sampled_from([0, 1, 1, 2, 3]))):
        which = draw(st.sampled_from([shape, strides]))
        which[draw(st.integers(0, len(which) - 1))] = draw(st.sampled_from(DIMENSION_EDGES))
    if draw(st.integers(0, 5)) == 0:
        strides = [0] * len(strides)  # every element on one byte
    handle = {"ticket": draw(weighted((8, st.just(Ref("ticket"))), (1, FIELD_OVERRIDES["ticket"]))),
              "offset": draw(st.sampled_from([0, 0, 0, 1, 8, 16384, 32767, 32768, 2**63 - 1])),
              "shape": shape, "strides": strides,
              "dtype": draw(weighted((6, st.just("uint8")), (1, FIELD_OVERRIDES["dtype"]))),
              "name": draw(st.sampled_from(["", "fuzz-segment", "x" * 256]))}
    count = draw(st.sampled_from([1, 2, 2, 2, 3, 4, 1024]))
    step = draw(st.sampled_from([16384, 16384, 0, 8192, 1, 32768, -16384]))
    layers = [dict(handle, offset=handle["offset"] + i * step) for i in range(count)]
    if draw(st.integers(0, 4)) == 0:
        layers[-1] = dict(handle, strides=list(reversed(strides)))  # not stackable
    block_size = shape[2] if layout == "mha" else shape[1]
    return {"model": FUZZ_MODEL, "kv_world_size": 1, "kv_worker_id": 0, "layout": layout,
            "block_size": draw(weighted((6, st.just(block_size)),
                                        (1, st.sampled_from([8, 16, 32, 256, 512])))),
            "layers": layers}


# Raw msgpack: any value, and bytes that are not (quite) msgpack.
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
    | st.text(max_size=12) | st.binary(max_size=12),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8) | st.binary(max_size=4) | st.integers(-3, 3),
                      children, max_size=4),
    max_leaves=24)
MSGPACK_ODDITIES = [
    b"", b"\xc1", b"\x80\x80", b"\x82\xa1a\x01\xa1a\x02",  # duplicate keys
    b"\xa2\xff\xfe", b"\x81\xa2\xff\xfe\x01",  # invalid UTF-8 in a value, in a key
    b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
    b"\xc6\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01",  # huge declared lengths
    b"\xd4\x01\x00", b"\xd6\xff\x00\x00\x00\x00", b"\xc7\x00\x05",  # ext types
    b"\x81\xa1a\xd6\xff\x00\x00\x00\x00",  # a timestamp inside a map
    b"\xca\x7f\xc0\x00\x00", b"\x81\xb0protocol_version\xca\x40\x00\x00\x00",  # float32
    b"\x81\xc4\x10protocol_version\x02",  # a bin key
    b"\x81\x01\x02", b"\x81\xc0\x02", b"\x81\x80\x02", b"\x81\x90\x02",  # non-str keys
    msgpack.packb({"x": [None] * MAX_ITEMS_PER_MESSAGE}),
    msgpack.packb({"x": [None] * (MAX_ITEMS_PER_MESSAGE + 1)}),
    msgpack.packb({str(i): i for i in range(MAX_MAP_FIELDS + 1)}),
    msgpack.packb({"x": "y" * (MAX_STRING_BYTES + 1)}),
    msgpack.packb({"x": b"y" * (MAX_STRING_BYTES + 1)}),  # bin has no string limit
]


def nested(depth: int, kind: str) -> bytes:
    return (b"\x91" if kind == "array" else b"\x81\xa1k") * depth + b"\xc0"


@st.composite
def garbage_payloads(draw) -> bytes:
    how = draw(st.sampled_from(["value", "value", "bytes", "truncated", "trailing", "nested",
                                "oddity"]))
    if how == "value":
        return msgpack.packb(draw(msgpack_values), use_bin_type=draw(st.booleans()))
    if how == "bytes":
        return draw(st.binary(max_size=200))
    if how == "nested":
        return nested(draw(st.sampled_from([10, 511, 512, 1023, 1024, 1025, 10_000, 100_000])),
                      draw(st.sampled_from(["array", "map"])))
    if how == "oddity":
        return draw(st.sampled_from(MSGPACK_ODDITIES))
    _, value = draw(op_payloads())
    packed = msgpack.packb(resolve(value, {"own": 1, "bystander": 2, "ticket": b"t" * 16}),
                           use_bin_type=True)
    if how == "truncated":
        return packed[:draw(st.integers(0, max(0, len(packed) - 1)))]
    return packed + draw(st.binary(min_size=1, max_size=8))


# Frames: ids of every length, op names known, near-known and random, payloads of all kinds.
KNOWN_OPS = [op.encode() for op in OPS]
id_frames = weighted(
    (4, st.integers(1, 2**64 - 1).map(rid)),
    (2, st.sampled_from([ZERO_ID, rid(1), rid(2**64 - 1), rid(2**63)])),
    (2, st.binary(max_size=12)))
op_frames = weighted(
    (4, st.sampled_from(KNOWN_OPS)),
    (1, st.sampled_from([b"", b"hello", b"PING\x00", b" PING", b"PING ", b"\xff\xfe",
                         b"P\xc3\xafNG", b"A" * 1000, b"CLEAR\n", b"__init__", b"OPS"])),
    (1, st.binary(max_size=16)))
payload_frames = weighted(
    (2, st.sampled_from([b"\x80", b"", b"\xc0"])),
    (3, op_payloads()),
    (1, st.binary(max_size=64)))


@st.composite
def envelopes(draw) -> list:
    """One message: its frames, 1 to 5 of them (a DEALER cannot send 0). A payload frame may
    be a (op, map) pair to be packed once the ids are known."""
    frames = [draw(id_frames), draw(op_frames), draw(payload_frames)]
    count = draw(st.sampled_from([1, 2, 3, 3, 3, 3, 3, 4, 5]))
    frames += [draw(st.binary(max_size=8)) for _ in range(max(0, count - 3))]
    if count < 3 and draw(st.booleans()):  # which frames are missing varies too
        frames = draw(st.permutations(frames))
    return frames[:count]


socket_modes = st.sampled_from(["main"] * 6 + ["fresh", "fresh_hello"] * 2)


# ---------------------------------------------------------------------------
# The harness: the fuzzing connection(s), the bystander, and the checks.

def envelope_error(frames: list[bytes]) -> str | None:
    """The code docs/protocol.md gives a message whose frames are wrong, None if they are right."""
    if len(frames) != 3 or len(frames[0]) != protocol.REQUEST_ID_BYTES or frames[0] == ZERO_ID:
        return "bad_frame"
    try:
        op = frames[1].decode("ascii")
    except UnicodeDecodeError:
        return "bad_frame"
    return None if op in OPS else "unknown_op"


def asks_progress(frames: list[bytes]) -> set[int]:
    """The progress_tag of a RETRIEVE among these frames that has one, as a set."""
    if len(frames) != 3 or frames[1] != b"RETRIEVE":
        return set()
    try:
        tag = msgpack.unpackb(frames[2], raw=False).get("progress_tag")
    except Exception:  # noqa: BLE001 (the fuzzer's payloads are anything)
        return set()
    if isinstance(tag, float) and tag.is_integer():  # integral floats are ints on the wire
        tag = int(tag)
    return {tag} if isinstance(tag, int) and tag else set()


class FuzzSocket:
    """A raw DEALER with a routing id of its own; `session`: HELLO was answered ok on it."""

    def __init__(self, context: zmq.Context, url: str):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTING_ID, b"fuzz-" + uuid.uuid4().bytes)
        self.socket.connect(url)
        self.session = False

    def recv(self, deadline: float) -> list[bytes] | None:
        timeout_ms = max(0, int((deadline - time.monotonic()) * 1000))
        if not self.socket.poll(timeout_ms, zmq.POLLIN):
            return None
        return self.socket.recv_multipart()

    def close(self) -> None:
        self.socket.close(linger=0)


class Refs(dict):
    """The values of Refs for one example; a ticket is asked for only when one is named."""

    def __init__(self, harness: Harness):
        super().__init__(own=harness.own_id or 1, bystander=harness.reg_source.instance_id)
        self.harness = harness

    def __missing__(self, key: str) -> bytes:
        assert key == "ticket", key
        ticket = self[key] = self.harness.new_ticket()
        return ticket


class Harness:
    """One server's fuzzing: the main fuzzing connection (HELLO said, its own registration
    of a small memfd cache), fresh connections on demand, the bystander (a CacheClient whose
    chunks must survive) and an admin client for STATS."""

    def __init__(self, server):
        self.server = server
        self.context = zmq.Context()
        self.ids = itertools.count(2**62)
        self.examples = 0
        self.counts: dict[str, int] = {}
        self.admin = server.client(admin=True, timeout=10.0)
        self.bystander = server.client(timeout=10.0, client_name="bystander")
        self.source = make_cache(BYSTANDER_BLOCKS, seed=5)
        self.target = make_cache(BYSTANDER_BLOCKS, seed=None)
        self.reg_source = self.bystander.register_kv_cache(
            self.source.handles(), model=MODEL, layout="mha", block_size=16)
        self.reg_target = self.bystander.register_kv_cache(
            self.target.handles(), model=MODEL, layout="mha", block_size=16)
        self.bystander_ids = {self.reg_source.instance_id, self.reg_target.instance_id}
        self.hashes = [os.urandom(16) for _ in range(4)]
        statuses = self.bystander.store(self.reg_source, [TransferItem.build(
            "bystander", self.hashes, BYSTANDER_SOURCE, BYSTANDER_SALT)])
        assert statuses == [bytes([StoreStatus.STORED] * 4)]
        self.expected = self.source.blocks(BYSTANDER_SOURCE).view(torch.uint8).clone()
        self.main = FuzzSocket(self.context, server.url)
        hello = self.call(self.main, HelloRequest(PROTOCOL_VERSION, "fuzzer"))
        self.fd_socket = hello.fd_socket
        self.fuzz_cache = SharedKVCache("mha", 2, FUZZ_BLOCKS, FUZZ_BLOCK_SIZE, 1, 8, torch.uint8)
        segment = self.fuzz_cache.segment
        segment.tensor().copy_(torch.randint(0, 256, (segment.size,), dtype=torch.uint8))
        self.own_id: int | None = None
        self.issued: set[bytes] = set()  # tickets the fuzzer's examples were given
        self.unsettled: list[bytes] = []  # of those, the ones that may still be pending
        self.consumed: set[bytes] = set()  # tickets a fuzzed REGISTER_KV_CACHE used
        self.fuzz_registrations: list[tuple[FuzzSocket, protocol.RegisterKVCacheReply]] = []
        self.register_fuzzer()
        self.checkpoint()
        self.baseline_fds = self.server_fds()

    def close(self) -> None:
        self.main.close()
        self.context.term()
        self.bystander.close()
        self.admin.close()
        for cache in (self.source, self.target, self.fuzz_cache):
            cache.close()

    def server_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.server.proc.pid}/fd"))

    # -- a correct exchange, for set-up --------------------------------------------------

    def call(self, sock: FuzzSocket, request: Any) -> Any:
        op = protocol.op_name(request)
        frames = [rid(next(self.ids)), op.encode(), protocol.pack(request)]
        sock.socket.send_multipart(frames)
        reply = sock.recv(time.monotonic() + REPLY_TIMEOUT_S)
        assert reply is not None and reply[0] == frames[0], (op, reply)
        if reply[1] != protocol.STATUS_OK:
            raise AssertionError(f"{op}: {protocol.unpack(ErrorReply, reply[2])}")
        if op == "HELLO":
            sock.session = True
        return protocol.unpack(OPS[op].reply, reply[2])

    def new_ticket(self) -> bytes:
        (ticket,) = send_fds(self.fd_socket, [self.fuzz_cache.segment.fd], REPLY_TIMEOUT_S)
        self.issued.add(ticket)
        self.unsettled.append(ticket)
        return ticket

    def settle_tickets(self) -> None:
        """Use up every ticket an example was given, so that the server holds no descriptor
        for them; a ticket a fuzzed registration used must be refused (single use)."""
        for ticket in self.unsettled:
            handles: list[TensorHandle] = [replace(h, ticket=ticket)
                                           for h in self.fuzz_cache.handles()]
            request = RegisterKVCacheRequest(FUZZ_MODEL, 1, 0, "mha", FUZZ_BLOCK_SIZE, handles)
            frames = [rid(next(self.ids)), b"REGISTER_KV_CACHE", protocol.pack(request)]
            self.main.socket.send_multipart(frames)
            reply = self.main.recv(time.monotonic() + REPLY_TIMEOUT_S)
            assert reply is not None and reply[0] == frames[0], reply
            if reply[1] == protocol.STATUS_OK:
                assert ticket not in self.consumed, "a ticket served two registrations"
                instance_id = protocol.unpack(protocol.RegisterKVCacheReply, reply[2]).instance_id
                self.call(self.main, protocol.UnregisterKVCacheRequest(instance_id))
            else:
                error = protocol.unpack(ErrorReply, reply[2])
                assert "unknown or expired ticket" in error.message, error
        self.unsettled = []

    def register_fuzzer(self) -> None:
        """The fuzzer's own registration, made properly, so that its STOREs go deep."""
        (ticket,) = send_fds(self.fd_socket, [self.fuzz_cache.segment.fd], REPLY_TIMEOUT_S)
        handles: list[TensorHandle] = [replace(h, ticket=ticket)
                                       for h in self.fuzz_cache.handles()]
        reply = self.call(self.main, RegisterKVCacheRequest(FUZZ_MODEL, 1, 0, "mha",
                                                            FUZZ_BLOCK_SIZE, handles))
        self.own_id = reply.instance_id

    # -- fuzzing ---------------------------------------------------------------------------

    def socket_for(self, mode: str) -> FuzzSocket:
        if mode == "main":
            if self.own_id is None:  # a fuzzed UNREGISTER_KV_CACHE took it
                self.register_fuzzer()
            return self.main
        sock = FuzzSocket(self.context, self.server.url)
        if mode == "fresh_hello":
            self.call(sock, HelloRequest(PROTOCOL_VERSION, "fuzzer"))
        return sock

    def run(self, mode: str, messages: list[list[Any]]) -> None:
        """Send the messages pipelined on one connection and check every reply."""
        sock = self.socket_for(mode)
        try:
            self.exchange(sock, messages)
            for owner, registration in self.fuzz_registrations:
                self.exercise(owner, registration)
        finally:
            # Even after a failure: each registration holds a descriptor in the server.
            for owner, registration in self.fuzz_registrations:
                with contextlib.suppress(AssertionError):
                    self.call(owner, protocol.UnregisterKVCacheRequest(registration.instance_id))
            self.fuzz_registrations = []
            if sock is not self.main:
                sock.close()
        self.examples += 1
        if self.examples % CHECK_EVERY == 0:
            self.checkpoint()

    def exercise(self, sock: FuzzSocket, registration: protocol.RegisterKVCacheReply) -> None:
        """Copies through a registration the fuzzer made: a chunk in, then out again."""
        ids = [i % registration.num_blocks for i in range(registration.blocks_per_chunk)]
        item = TransferItem.build("exercise", [os.urandom(16)], ids, "fuzz")
        results = []
        for request in (protocol.StoreRequest(registration.instance_id, [item]),
                        RetrieveRequest(registration.instance_id, [item])):
            op = protocol.op_name(request)
            frames = [rid(next(self.ids)), op.encode(), protocol.pack(request)]
            sock.socket.send_multipart(frames)
            reply = sock.recv(time.monotonic() + REPLY_TIMEOUT_S)
            assert reply is not None and reply[0] == frames[0], (op, reply, self.diagnose())
            if reply[1] != protocol.STATUS_OK:
                error = protocol.unpack(ErrorReply, reply[2])
                assert error.code != "internal", f"{op} into {registration}: {error.message}"
                return
            results.append(protocol.unpack(OPS[op].reply, reply[2]))
        stored, retrieved = results[0].results, results[1].retrieved
        assert len(stored) == 1 and len(stored[0]) == 1 and retrieved in ([0], [1]), results
        if stored[0][0] == StoreStatus.STORED:
            assert retrieved == [1], results

    def exchange(self, sock: FuzzSocket, messages: list[list[Any]]) -> None:
        refs = Refs(self)
        by_id: dict[bytes, list[bytes]] = {}
        unreadable: list[list[bytes]] = []
        progress_tags: set[int] = set()  # of RETRIEVEs sent: LOAD_PROGRESS may come for them
        for message in messages:
            frames = [msgpack.packb(resolve(f[1], refs), use_bin_type=True)
                      if isinstance(f, tuple) else f for f in message]
            progress_tags |= asks_progress(frames)
            # Beyond the limit ZeroMQ drops the connection without a reply (docs/protocol.md):
            # the strategies stay far below it.
            assert sum(map(len, frames)) < MAX_MESSAGE_BYTES // 4, "the fuzzer made a huge message"
            if len(frames[0]) == protocol.REQUEST_ID_BYTES and frames[0] != ZERO_ID:
                while frames[0] in by_id:  # one reply per id: keep this example's ids apart
                    frames[0] = rid(next(self.ids))
                by_id[frames[0]] = frames
            else:
                unreadable.append(frames)
            sock.socket.send_multipart(frames)
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while by_id or unreadable:
            reply = sock.recv(deadline)
            assert reply is not None, (
                f"no reply within {REPLY_TIMEOUT_S} s to "
                f"{[f[:2] for f in [*by_id.values(), *unreadable]]}; {self.diagnose()}")
            assert len(reply) == 3, reply
            if reply[0] == ZERO_ID and reply[1] == protocol.STATUS_OK:
                # A push message: only LOAD_PROGRESS, for a RETRIEVE that asked for it.
                notice = protocol.unpack_push(reply[2])
                assert isinstance(notice, protocol.LoadProgress), notice
                assert notice.tag in progress_tags and notice.layers >= 1, notice
                continue
            if reply[0] == ZERO_ID and unreadable:
                self.check(sock, unreadable.pop(0), reply, refs["own"])
            else:
                assert reply[0] in by_id, f"a reply nobody asked for: {reply}"
                self.check(sock, by_id.pop(reply[0]), reply, refs["own"])
        # Nothing more may come: the next reply is the one to this PING.
        ping = [rid(next(self.ids)), b"PING", b"\x80"]
        sock.socket.send_multipart(ping)
        reply = sock.recv(time.monotonic() + REPLY_TIMEOUT_S)
        assert reply is not None and reply[:2] == [ping[0], b"ok"], \
            f"a second reply, or none to PING: {reply}"

    def check(self, sock: FuzzSocket, frames: list[bytes], reply: list[bytes], own_id: int
              ) -> None:
        """What any reply to these frames must be; `own_id`: the fuzzer's registration when
        they were sent (a pipelined UNREGISTER_KV_CACHE may end it before their reply)."""
        request_id, status, payload = reply
        readable = len(frames[0]) == protocol.REQUEST_ID_BYTES
        assert request_id == (frames[0] if readable else ZERO_ID), (frames[:2], reply)
        assert status in (protocol.STATUS_OK, protocol.STATUS_ERR), reply
        envelope = envelope_error(frames)
        op = frames[1].decode() if envelope is None else None
        if status == protocol.STATUS_ERR:
            error = protocol.unpack(ErrorReply, payload)
            key = f"{op or '-'}:{error.code}"
            self.counts[key] = self.counts.get(key, 0) + 1
            assert error.code in ERROR_CLASSES and error.message, error
            assert error.code not in ("internal", "shutting_down"), (
                f"{op or frames[1][:32]!r}: {error.code}: {error.message}\n"
                f"payload {frames[2][:300] if len(frames) > 2 else None!r}")
            if envelope is not None:
                assert error.code == envelope, (frames[:2], error)
            if error.code == "unauthenticated" and op not in (None, "HELLO"):
                assert not sock.session, f"{op}: the session was lost: {error.message}"
            if (sock is self.main and op in ("STORE", "RETRIEVE", "UNREGISTER_KV_CACHE")
                    and error.code == "unknown_instance"):
                request = protocol.unpack(OPS[op].request, frames[2])
                assert request.instance_id != self.own_id, \
                    f"{op}: the fuzzer's own registration was lost: {error.message}"
            return
        self.counts[f"{op}:ok"] = self.counts.get(f"{op}:ok", 0) + 1
        assert envelope is None and op is not None, (frames[:2], "answered ok")
        result = protocol.unpack(OPS[op].reply, payload)
        request = protocol.unpack(OPS[op].request, frames[2])
        assert op in ("HELLO", "PING") or sock.session, f"{op} served without a session"
        assert op not in ADMIN_OPS, f"{op} served to an engine session"
        if op == "HELLO":
            assert result.role == protocol.ROLE_ENGINE, result
            sock.session = True
        elif op == "STATS":
            assert result.tenants == {}, "an engine saw per-tenant figures"
            seen = {i.instance_id for i in result.instances}
            assert not seen & self.bystander_ids, "an engine saw another engine's registration"
        elif op == "REGISTER_KV_CACHE":
            tickets = {h.ticket for h in request.layers if isinstance(h, protocol.MemfdHandle)}
            assert tickets and tickets <= self.issued, \
                "registered with a ticket the fd channel never issued"
            assert not tickets & self.consumed, "a ticket served two registrations"
            self.consumed |= tickets
            self.fuzz_registrations.append((sock, result))
        elif op in ("STORE", "RETRIEVE", "UNREGISTER_KV_CACHE"):
            assert request.instance_id not in self.bystander_ids, \
                f"{op} on the bystander's registration, from another connection"
            assert sock is self.main and request.instance_id == own_id, (op, request)
            if op == "UNREGISTER_KV_CACHE":
                self.own_id = None
        if op == "LOOKUP":
            assert len(result.hits) == len(request.items)
            for hit, item in zip(result.hits, request.items):
                assert 0 <= hit <= len(item.chunk_hashes) // 16
        elif op == "STORE":
            assert [len(r) for r in result.results] == [len(i.chunk_hashes) // 16
                                                       for i in request.items]
            assert all(s <= StoreStatus.NO_PREFIX for r in result.results for s in r)
        elif op == "RETRIEVE":
            assert len(result.retrieved) == len(request.items)
            for n, item in zip(result.retrieved, request.items):
                assert 0 <= n <= len(item.chunk_hashes) // 16

    def diagnose(self) -> str:
        """What the server is up to, for a failure message."""
        alive = self.server.proc.poll() is None
        try:
            stats = self.admin.stats()
            state = (f"pending_stores {stats.pending_stores}, leases_held {stats.leases_held}, "
                     f"registrations {stats.registrations}")
        except Exception as exc:  # the server may be stuck: say so
            state = f"STATS failed: {exc!r}"
        return (f"server {'alive' if alive else 'dead'}; {state}; log tail:\n"
                f"{self.server.output()[-2000:]}")

    # -- the bystander -----------------------------------------------------------------------

    def checkpoint(self) -> None:
        """The server lives, and the bystander's chunks come back byte for byte into its own
        second cache, through registrations that are still the ones it made."""
        self.server.check_alive()
        self.settle_tickets()
        for layer in self.target.layers:
            layer.view(torch.uint8).zero_()
        reply = self.bystander.rpc.call(RetrieveRequest(self.reg_target.instance_id, [
            TransferItem.build(f"check-{self.examples}", self.hashes, BYSTANDER_TARGET,
                               BYSTANDER_SALT)]))
        assert reply.retrieved == [4]
        assert torch.equal(self.target.blocks(BYSTANDER_TARGET).view(torch.uint8), self.expected)
        assert self.bystander.ping() > 0
        stats = self.admin.stats()
        assert self.bystander_ids <= {i.instance_id for i in stats.instances}
        self.server.check_alive()

    def describe_fds(self) -> str:
        kinds: dict[str, int] = {}
        directory = f"/proc/{self.server.proc.pid}/fd"
        for fd in os.listdir(directory):
            try:
                target = os.readlink(f"{directory}/{fd}").split(":[")[0]
            except OSError:
                continue
            kinds[target] = kinds.get(target, 0) + 1
        return ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))

    def final_check(self) -> None:
        self.checkpoint()
        stats = self.admin.stats()
        assert stats.pending_stores == 0, stats
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while (fds := self.server_fds()) > self.baseline_fds + FD_SLACK:
            assert time.monotonic() < deadline, (
                f"the server holds {fds} descriptors, {self.baseline_fds} after set-up: "
                f"{self.describe_fds()}")
            time.sleep(0.05)


@pytest.fixture(scope="module")
def harness():
    # A long worker timeout: the fuzzer's own registration must not expire between tests.
    with run_server("--worker-timeout", "600", "--quota", f"{BYSTANDER_SALT}=unlimited:8MiB"
                    ) as server:
        h = Harness(server)
        try:
            yield h
        finally:
            print(f"\nfuzz: {h.examples} examples, replies {sorted(h.counts.items())}")
            h.close()


# ---------------------------------------------------------------------------
# The tests: envelopes, typed payloads per op, raw msgpack, registrations' geometry; then
# the bystander's final check.

@fuzz_settings(0.25)
@given(mode=socket_modes, messages=st.lists(envelopes(), min_size=1, max_size=3))
@example(mode="main", messages=[[b""]])
@example(mode="main", messages=[[ZERO_ID, b"PING", b"\x80"]])
@example(mode="main", messages=[[ZERO_ID]])
@example(mode="main", messages=[[rid(7), b"PING"], [b"\x01", b"PING", b"\x80"]])
@example(mode="fresh", messages=[[rid(1), b"STATS", b"\x80"], [rid(2), b"CLEAR", b"\x80"]])
@example(mode="main", messages=[[rid(3), b"CLEAR", b"\x80"], [rid(4), b"QUOTA_LIST", b"\x80"]])
def test_fuzz_envelopes(harness, mode, messages):
    harness.run(mode, messages)


@fuzz_settings(0.4)
@given(mode=socket_modes, payloads=st.lists(op_payloads(), min_size=1, max_size=2))
@example(mode="fresh", payloads=[("UNREGISTER_KV_CACHE", {"instance_id": Ref("bystander")})])
@example(mode="main", payloads=[("UNREGISTER_KV_CACHE", {"instance_id": Ref("bystander", True)})])
@example(mode="main", payloads=[("STORE", {"instance_id": Ref("bystander"), "items": []})])
@example(mode="main", payloads=[("LOOKUP", {
    "model": FUZZ_MODEL, "kv_world_size": MAX_LOOKUP_PROBES // MAX_CHUNKS_PER_MESSAGE,
    "items": [{"request_id": "r", "chunk_hashes": HASH_POOL[0] * MAX_CHUNKS_PER_MESSAGE,
               "hold": True}]})])
@example(mode="main", payloads=[("LOOKUP", {
    "model": FUZZ_MODEL, "kv_world_size": MAX_LOOKUP_PROBES // MAX_CHUNKS_PER_MESSAGE + 1,
    "items": [{"request_id": "r", "chunk_hashes": HASH_POOL[0] * MAX_CHUNKS_PER_MESSAGE}]})])
def test_fuzz_payloads(harness, mode, payloads):
    harness.run(mode, [[rid(i + 1), op.encode(), (op, value)]
                       for i, (op, value) in enumerate(payloads)])


@fuzz_settings(0.2)
@given(mode=socket_modes, op=st.sampled_from(KNOWN_OPS), payload=garbage_payloads())
@example(mode="main", op=b"HELLO", payload=nested(100_000, "array"))
@example(mode="main", op=b"LOOKUP", payload=nested(100_000, "map"))
def test_fuzz_raw_msgpack(harness, mode, op, payload):
    harness.run(mode, [[rid(1), op, payload]])


def register_request(shape: list[int], strides: list[int], ticket: Any = Ref("ticket")) -> dict:
    layer = {"ticket": ticket, "offset": 0, "shape": shape, "strides": strides, "dtype": "uint8"}
    return {"model": FUZZ_MODEL, "kv_world_size": 1, "kv_worker_id": 0, "layout": "mha",
            "block_size": FUZZ_BLOCK_SIZE, "layers": [layer]}


# Found by this fuzzer: layers whose element count overflows int64 (or whose sizes or
# strides do not fit it) were answered `internal` (torch's RuntimeError or TypeError from
# as_strided), and layers whose elements share addresses (zero strides) were registered.
OVERFLOWING_LAYERS = [
    ([2, 2**62, 16, 1, 8], [0, 0, 0, 0, 0]),
    ([2, FUZZ_BLOCKS, 16, 1, 2**62], [0, 0, 0, 0, 0]),
    ([2, 2**64 - 1, 16, 1, 8], [0, 0, 0, 0, 0]),
    ([2, FUZZ_BLOCKS, 16, 1, 8], [8192, 128, 8, 2**63, 1]),
    ([2, FUZZ_BLOCKS, 16, 1, 8], [8192, 128, 8, 2**64 - 1, 1]),
]
ALIASING_LAYERS = [([2, FUZZ_BLOCKS, 16, 1, 8], [0, 0, 0, 0, 0]),
                   ([2, FUZZ_BLOCKS, 16, 1, 8], [1, 1, 1, 1, 1]),
                   ([2, FUZZ_BLOCKS, 16, 1, 8], [0, 512, 8, 8, 1])]  # K and V on one address


@fuzz_settings(0.15)
@given(mode=st.sampled_from(["main", "main", "fresh_hello"]), request=registrations())
@example(mode="main", request=register_request(*OVERFLOWING_LAYERS[0]))
@example(mode="main", request=register_request(*OVERFLOWING_LAYERS[4]))
@example(mode="main", request=register_request(*ALIASING_LAYERS[0]))
def test_fuzz_registrations(harness, mode, request):
    harness.run(mode, [[rid(1), b"REGISTER_KV_CACHE", ("REGISTER_KV_CACHE", request)]])


@pytest.mark.parametrize("shape,strides", OVERFLOWING_LAYERS + ALIASING_LAYERS)
def test_layers_that_overflow_or_alias_are_refused_as_bad_requests(harness, shape, strides):
    """Regression: checked before the memory is mapped and viewed, with a real ticket."""
    request = resolve(register_request(shape, strides), {"ticket": harness.new_ticket()})
    frames = [rid(next(harness.ids)), b"REGISTER_KV_CACHE", msgpack.packb(request)]
    harness.main.socket.send_multipart(frames)
    reply = harness.main.recv(time.monotonic() + REPLY_TIMEOUT_S)
    assert reply is not None and reply[:2] == [frames[0], protocol.STATUS_ERR], reply
    error = protocol.unpack(ErrorReply, reply[2])
    assert error.code == "bad_request", error
    assert "strides" in error.message or "one address" in error.message, error


def test_float8_layers_in_cpu_memory_round_trip(harness):
    """Regression (found by test_fuzz_registrations): STORE from a float8 cache worked, but
    RETRIEVE into one wrote nothing (retrieved 0): torch has no index_copy_ for float8 on
    the CPU."""
    blocks = 2 * FUZZ_BLOCKS_PER_CHUNK
    with harness.server.client() as client, \
            SharedKVCache("mha", 2, blocks, FUZZ_BLOCK_SIZE, 1, 8, torch.float8_e4m3fn) as cache:
        raw = cache.segment.tensor()
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        registration = client.register_kv_cache(cache.handles(), model="fp8-model",
                                                layout="mha", block_size=FUZZ_BLOCK_SIZE)
        source = list(range(FUZZ_BLOCKS_PER_CHUNK))
        target = list(range(FUZZ_BLOCKS_PER_CHUNK, blocks))[::-1]
        hashes = [os.urandom(16)]
        assert client.store(registration, [TransferItem.build("s", hashes, source)]) == [
            bytes([StoreStatus.STORED])]
        assert client.retrieve(registration, [TransferItem.build("r", hashes, target)]) == [1]
        assert torch.equal(cache.blocks(target).view(torch.uint8),
                           cache.blocks(source).view(torch.uint8))
        client.unregister(registration)


def test_bystander_intact_after_fuzzing(harness):
    harness.final_check()
