"""Bounded work: no request makes the server work long enough to starve another client.

An attacker process pipelines the costliest requests the limits allow (LOOKUPs of
MAX_LOOKUP_PROBES index probes) or messages whose decoding alone would be costly, while a
bystander (this process) sends STATS after STATS, each saying how many of the flood's
requests the server had answered by then; messages over a limit are refused with
bad_request naming it, before any work (counted in the server's CPU seconds).
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

# A refusal may cost the server's process a few times the CPU of a PING and its check,
# plus a slack for reading its frames (the server's process is traced under CI's coverage,
# the test's too); decoding what a limit bounds (a million items) would cost a hundred
# times more. CPU time, not wall time: another job on the cores does not add to it.
REFUSAL_FACTOR, REFUSAL_SLACK_S, TRIES = 6, 0.005, 5
# The bystander's round trips while the flood is answered, at the least: one a turn of the
# loop's reading (each turn reads a message of each client) would make one per flood
# request; a server that answered the flood before the bystander, none.
ROUNDS_DURING_FLOOD = 5
HANG_S = 120.0  # what only a hang takes (traced by coverage on busy cores, over 10 s)


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

def flood(state, url: str, op: str, payload: bytes, count: int) -> None:
    """Pipeline `count` copies, then read the replies in a thread as they come."""
    if "raw" in state:
        state["raw"].close()
    raw = state["raw"] = RawClient(url, hwm=0, timeout_ms=int(HANG_S * 1000))
    raw.hello()
    sent = [raw.send(op, payload) for _ in range(count)]
    replies: list = []
    reader = threading.Thread(target=lambda: replies.extend(
        raw.recv() for _ in sent))  # the socket is the thread's from now
    reader.start()
    state["flood"] = sent, replies, reader


def collect(state, wait_s: float) -> dict:
    sent, replies, reader = state["flood"]
    reader.join(wait_s)
    return {"ids": [r[0] for r in replies], "sent": sent,
            "outcomes": Counter(body.get("code", "ok") if status == b"err" else "ok"
                                for _, status, body in replies),
            "messages": {body["message"] for _, status, body in replies if status == b"err"},
            "hits": {tuple(body["hits"]) for _, status, body in replies if status == b"ok"}}


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
def test_a_bystander_is_served_while_another_client_floods_costly_requests(
        server, attacker, attack):
    """Counted in the server's own figures, not timed: each of the bystander's STATS says
    how many of the flood's requests the server had answered by then."""
    make_payload, count, outcome = FLOODS[attack]
    payload = make_payload()
    with server.client(timeout=60) as bystander:

        def lookups_answered() -> int:
            return bystander.stats().outcomes.get("LOOKUP", {}).get(outcome, 0)
        before = lookups_answered()
        attacker.run(flood, server.url, "LOOKUP", payload, count)
        answered, deadline = [lookups_answered() - before], time.monotonic() + HANG_S
        while answered[-1] < count:  # STATS after STATS, none waiting for the one before
            assert time.monotonic() < deadline, answered[-10:]  # ends a hang only
            answered.append(lookups_answered() - before)
        result = attacker.run(collect, HANG_S, wait=HANG_S + 10)
        stats = bystander.stats()
    # Every request got its one reply, in order, and the bystander's ran while the flood's
    # did: a turn of the loop serves the flood a slice at a time, never all of it.
    assert result["ids"] == result["sent"]
    assert result["outcomes"] == {outcome: count}
    assert answered == sorted(answered)
    during = sum(1 for figure in answered if figure < count)
    assert during >= ROUNDS_DURING_FLOOD, answered
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


def server_cpu(raw: RawClient, call) -> tuple[float, Any]:
    """CPU seconds the server's process spent over TRIES runs of call() (round trips on
    `raw`), by its own count in STATS; and call()'s result."""
    before, result = raw.call("STATS", {})[1]["cpu_seconds"], None
    for _ in range(TRIES):
        result = call()
    return raw.call("STATS", {})[1]["cpu_seconds"] - before, result


def cpu_here(call) -> float:
    """CPU seconds this thread spent over TRIES runs of call()."""
    started = time.thread_time()
    for _ in range(TRIES):
        call()
    return time.thread_time() - started


def decoded_here(op: str, payload: bytes) -> None:
    """What the server does first: decode with the request limits, which refuses most of
    these (the rest, such as too many chunks, are counted from the decoded request)."""
    with contextlib.suppress(BadRequest):
        protocol.unpack(protocol.OPS[op].request, payload, bounded=True)


def test_requests_over_the_limits_are_refused_naming_the_limit(server):
    """Each refusal names its limit, and comes before the work the limit bounds: a refusal
    costs the server's process no more CPU than a PING plus the same check run here
    (decoding with the request limits), a few times over. Each figure is the CPU time of
    TRIES tries, which the machine's load does not move (a tracer slows all alike)."""
    with RawClient(server.url) as raw:
        raw.hello()
        outcomes, slow = {}, {}
        for label, (op, payload, words) in LIMITS.items():
            ping, _ = server_cpu(raw, partial(raw.call, "PING", {}))
            check = cpu_here(partial(decoded_here, op, payload))
            refusal, (status, body) = server_cpu(raw, partial(raw.call, op, payload))
            outcomes[label] = (status, body.get("code"), words in body.get("message", ""),
                               body.get("message"))
            if refusal > REFUSAL_FACTOR * (ping + check) + REFUSAL_SLACK_S:
                slow[label] = (f"{refusal * 1000:.1f} ms of CPU against a PING's "
                               f"{ping * 1000:.2f} ms and the check's {check * 1000:.2f} ms here")
        assert raw.call("PING", {})[0] == b"ok"
    wrong = {label: outcome[3] for label, outcome in outcomes.items()
             if outcome[:3] != (b"err", "bad_request", True)}
    assert wrong == {}
    assert slow == {}, "refusals slower than their check: work done before it"

