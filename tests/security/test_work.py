"""Bounded work: no request makes the server work long enough to starve another client.

An attacker process pipelines the costliest requests the limits allow (LOOKUPs of
MAX_LOOKUP_PROBES index probes) or messages whose decoding alone would be costly, while a
bystander (this process) times PING round trips; messages over a limit are refused with
bad_request naming it, before any work.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from functools import partial
from typing import Any

import msgpack
import pytest

from lmcache_mp import protocol
from lmcache_mp.errors import BadRequest
from lmcache_mp.protocol import (
    MAX_CHUNKS_PER_MESSAGE,
    MAX_ITEMS_PER_MESSAGE,
    MAX_KV_WORLD_SIZE,
    MAX_LOOKUP_PROBES,
    MAX_MAP_FIELDS,
    MAX_REQUEST_ID_CHARS,
    MAX_REQUEST_VALUES,
    MAX_STRING_BYTES,
)

from ..utils import run_server
from .agents import Agent, RawClient

# A refusal may take a few times a PING and its check, plus a slack for reading its frames
# (the server's process is traced under CI's coverage, the test's too, and another job may
# share the cores); decoding what a limit bounds (a million items) would take a hundred
# times longer.
REFUSAL_FACTOR, REFUSAL_SLACK_S, TRIES = 6, 0.005, 5
PING_BOUND_S = 0.150  # p99 of the bystander's round trips; seconds before the limits
PINGS = 200


@pytest.fixture(scope="module")
def server():
    with run_server("--cpu-size", "64MiB") as srv:
        yield srv


def array_header(n: int) -> bytes:
    return b"\xdc" + n.to_bytes(2, "big") if n < 2**16 else b"\xdd" + n.to_bytes(4, "big")


def lookup_payload(items: bytes | list, kv_world_size: int = 1) -> bytes:
    """A LOOKUP map whose `items` may be raw msgpack bytes of any shape."""
    head = msgpack.packb({"model": "m", "kv_world_size": kv_world_size})
    items = items if isinstance(items, bytes) else msgpack.packb(items, use_bin_type=True)
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb("items") + items


def amplified_lookup() -> bytes:
    """MAX_LOOKUP_PROBES probes: kv_world_size 1024 times 256 items of one hash each (each
    item probes every kv worker for its first hash), with holds."""
    items = [{"request_id": f"amp{i}", "chunk_hashes": os.urandom(16), "hold": True}
             for i in range(MAX_LOOKUP_PROBES // MAX_KV_WORLD_SIZE)]
    return lookup_payload(items, MAX_KV_WORLD_SIZE)


def nested_empty_items(*sizes: int) -> bytes:
    """Arrays of arrays ... of empty maps as `items`, e.g. sizes (1000, 1000): a million
    empty items, though every array is within MAX_ITEMS_PER_MESSAGE."""
    body = b"\x80"
    for size in reversed(sizes):
        body = array_header(size) + body * size
    return lookup_payload(body)


def nested_maps(depth: int) -> bytes:
    """Maps of MAX_MAP_FIELDS maps ... : 64^depth values, every map within its limit."""
    value: dict = {}
    for _ in range(depth):
        value = {f"k{i}": value for i in range(MAX_MAP_FIELDS)}
    return msgpack.packb(value)


# ---------------------------------------------------------------------------
# Floods, with a bystander.

def flood(state, url: str, op: str, payload: bytes, count: int) -> float:
    """Pipeline `count` copies, then read the replies in a thread as they come, noting when;
    return when the first copy was sent."""
    if "raw" in state:
        state["raw"].close()
    raw = state["raw"] = RawClient(url, hwm=0)
    raw.hello()
    started = time.monotonic()
    sent = [raw.send(op, payload) for _ in range(count)]
    replies: list = []
    reader = threading.Thread(target=lambda: replies.extend(
        (*raw.recv(), time.monotonic()) for _ in sent))  # the socket is the thread's from now
    reader.start()
    state["flood"] = sent, replies, reader
    return started


def collect(state, wait_s: float) -> dict:
    sent, replies, reader = state["flood"]
    reader.join(wait_s)
    return {"ids": [r[0] for r in replies], "sent": sent,
            "finished": replies[-1][3] if replies else None,
            "outcomes": Counter(body.get("code", "ok") if status == b"err" else "ok"
                                for _, status, body, _ in replies),
            "messages": {body["message"] for _, status, body, _ in replies if status == b"err"},
            "hits": {tuple(body["hits"]) for _, status, body, _ in replies if status == b"ok"}}


def p99(samples: list[float]) -> float:
    return sorted(samples)[int(len(samples) * 0.99) - 1]


FLOODS = {
    # op, payload, copies, the reply each gets
    "amplified LOOKUPs": (amplified_lookup, 25, "ok"),
    # 4,000,000 empty items per message in 4 MiB: 0.4 s of decoding each before
    # MAX_REQUEST_VALUES.
    "nested empty items": (lambda: nested_empty_items(4, 1000, 1000), 40, "bad_request"),
}


@pytest.fixture(scope="module")
def attacker():
    agent = Agent("attacker")
    yield agent
    agent.close()


@pytest.mark.slow
@pytest.mark.parametrize("attack", list(FLOODS))
def test_a_bystander_stays_fast_while_another_client_floods_costly_requests(
        server, attacker, attack):
    make_payload, count, outcome = FLOODS[attack]
    payload = make_payload()
    with server.client(timeout=10) as bystander:
        bystander.ping()
        started = attacker.run(flood, server.url, "LOOKUP", payload, count)
        rtts = []
        for _ in range(PINGS):
            sent = time.perf_counter()
            bystander.ping()
            rtts.append(time.perf_counter() - sent)
            if len(rtts) == 1:
                first_pong = time.monotonic()
            time.sleep(0.002)
        result = attacker.run(collect, 60)
        stats = bystander.stats()
    # Every request got its one reply, in order, and the pings ran while the flood did.
    assert result["ids"] == result["sent"]
    assert result["outcomes"] == {outcome: count}
    assert started < first_pong < result["finished"], \
        f"the flood was answered {result['finished'] - started:.3f} s after it began, before " \
        f"the bystander's first pong"
    assert p99(rtts) < PING_BOUND_S, f"bystander p99 {p99(rtts) * 1000:.0f} ms, max " \
                                     f"{max(rtts) * 1000:.0f} ms"
    if outcome == "ok":
        assert result["hits"] == {(0,) * (MAX_LOOKUP_PROBES // MAX_KV_WORLD_SIZE)}
    else:
        assert result["messages"] == {f"payload holds more than {MAX_REQUEST_VALUES} values in "
                                      f"its arrays and maps (MAX_REQUEST_VALUES)"}
    assert stats.leases_held == 0
    server.check_alive()


# ---------------------------------------------------------------------------
# Over the limits: refused before any work, naming the limit.

LIMITS = {
    "1,000,000 empty items": (
        "LOOKUP", lookup_payload(array_header(1_000_000) + b"\x80" * 1_000_000),
        "an array of 1000000 elements, more than MAX_ITEMS_PER_MESSAGE"),
    "1,000,000 empty items, nested 1000 x 1000": (
        "LOOKUP", nested_empty_items(1000, 1000),
        f"more than {MAX_REQUEST_VALUES} values in its arrays and maps"),
    "maps nested in maps, 64 wide": (
        "PING", nested_maps(3), f"more than {MAX_REQUEST_VALUES} values in its arrays and maps"),
    f"{MAX_ITEMS_PER_MESSAGE + 1} items": (
        "LOOKUP", lookup_payload([{"request_id": "r", "chunk_hashes": b""}]
                                 * (MAX_ITEMS_PER_MESSAGE + 1)),
        f"an array of {MAX_ITEMS_PER_MESSAGE + 1} elements, more than MAX_ITEMS_PER_MESSAGE"),
    f"{MAX_CHUNKS_PER_MESSAGE + 1} chunks": (
        "LOOKUP", lookup_payload([{"request_id": "r", "chunk_hashes": os.urandom(16) * 2049},
                                  {"request_id": "s", "chunk_hashes": os.urandom(16) * 2048}]),
        f"`items`: {MAX_CHUNKS_PER_MESSAGE + 1} chunks in one message; the limit is "
        f"{MAX_CHUNKS_PER_MESSAGE}"),
    "probes over MAX_LOOKUP_PROBES": (
        "LOOKUP", lookup_payload([{"request_id": "r", "chunk_hashes": os.urandom(16) * 257}],
                                 MAX_KV_WORLD_SIZE),
        f"`items`: {257 * MAX_KV_WORLD_SIZE} index probes (chunk hashes times kv_world_size "
        f"{MAX_KV_WORLD_SIZE}) in one LOOKUP; the limit is {MAX_LOOKUP_PROBES}"),
    "kv_world_size over MAX_KV_WORLD_SIZE": (
        "LOOKUP", lookup_payload([], MAX_KV_WORLD_SIZE + 1),
        f"`kv_world_size`: must be in [1, {MAX_KV_WORLD_SIZE}]"),
    "an array 2^32-1 long (header only)": (
        "LOOKUP", lookup_payload(b"\xdd\xff\xff\xff\xff"),
        "an array of 4294967295 elements, more than MAX_ITEMS_PER_MESSAGE"),
    "arrays nested 100,000 deep": (
        "LOOKUP", lookup_payload(b"\x91" * 100_000 + b"\xc0"),
        "(StackError: arrays and maps nested more than 1024 deep)"),
    f"a map of {MAX_MAP_FIELDS + 1} keys": (
        "STATS", msgpack.packb({f"k{i}": i for i in range(MAX_MAP_FIELDS + 1)}),
        f"a map of {MAX_MAP_FIELDS + 1} keys, more than MAX_MAP_FIELDS"),
    f"a string of {MAX_STRING_BYTES + 1} bytes": (
        "LOOKUP", msgpack.packb({"model": "m" * (MAX_STRING_BYTES + 1), "kv_world_size": 1,
                                 "items": []}),
        f"a string of {MAX_STRING_BYTES + 1} bytes, more than MAX_STRING_BYTES"),
    f"a request_id of {MAX_REQUEST_ID_CHARS + 1} characters": (
        "LOOKUP", lookup_payload([{"request_id": "r" * (MAX_REQUEST_ID_CHARS + 1),
                                   "chunk_hashes": b""}]),
        f"`items[0].request_id`: at most {MAX_REQUEST_ID_CHARS} characters"),
    "a map key that is not a string": (
        "PING", b"\x81\x01\x02", "not valid msgpack"),
}


def fastest(call, tries: int = TRIES) -> tuple[float, Any]:
    """The fastest of `tries` runs of call(), and its result: a stall of one try (the
    machine's load) does not count."""
    best, result = float("inf"), None
    for _ in range(tries):
        started = time.perf_counter()
        result = call()
        best = min(best, time.perf_counter() - started)
    return best, result


def decoded_here(op: str, payload: bytes) -> None:
    """What the server does first: decode with the request limits, which refuses most of
    these (the rest, such as too many chunks, are counted from the decoded request)."""
    with contextlib.suppress(BadRequest):
        protocol.unpack(protocol.OPS[op].request, payload, bounded=True)


def test_requests_over_the_limits_are_refused_naming_the_limit(server):
    """Each refusal names its limit, and comes before the work the limit bounds: the
    server's refusal takes no longer than a PING round trip plus the same check run here
    (decoding with the request limits), a few times over. Each figure is the fastest
    of TRIES tries, taken in turn, so that the machine's load (or a tracer) slows all alike."""
    with RawClient(server.url) as raw:
        raw.hello()
        outcomes, slow = {}, {}
        for label, (op, payload, words) in LIMITS.items():
            ping, _ = fastest(partial(raw.call, "PING", {}))
            check, _ = fastest(partial(decoded_here, op, payload))
            refusal, (status, body) = fastest(partial(raw.call, op, payload))
            outcomes[label] = (status, body.get("code"), words in body.get("message", ""),
                               body.get("message"))
            if refusal > REFUSAL_FACTOR * (ping + check) + REFUSAL_SLACK_S:
                slow[label] = (f"{refusal * 1000:.1f} ms against a PING's {ping * 1000:.2f} ms "
                               f"and the check's {check * 1000:.2f} ms here")
        assert raw.call("PING", {})[0] == b"ok"
    wrong = {label: outcome[3] for label, outcome in outcomes.items()
             if outcome[:3] != (b"err", "bad_request", True)}
    assert wrong == {}
    assert slow == {}, "refusals slower than their check: work done before it"

