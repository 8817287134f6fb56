"""Push messages, LOAD_DONE and MLA as docs/protocol.md says: the push frames match the code;
the MLA example exchange (a leader and a follower of one engine on two connections, with the
follower's LOAD_DONE push) replays against a real server; with a W3-like cache only the
leader stores and retrieves, its RETRIEVE lands byte for byte in its own engine's followers
and no other cache, each follower hears one LOAD_DONE per RETRIEVE, and STATS `instances`
counts it all."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import struct
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import torch
import zmq

from lmcache_mp import protocol

from ..utils import rid
from ..workers import MLA, chunk_blocks, expected_blocks, make_cache, prompt
from .document import (
    DOC,
    Placeholder,
    code_fields,
    doc_operations,
    fenced_blocks,
    parse_messages,
    section,
    substitute,
    table_at,
)
from .wire import (
    REPLY_TIMEOUT_MS,
    call,
    check_reply,
    fd_socket,
    fixed_identity_dealer,
    hello,
    refused,
    running_server,
    session,
    ticket_for,
    wire_handles,
)

# ---------------------------------------------------------------------------
# MLA and push messages.

def _push_section() -> list[str]:
    return section("## Push messages")


def test_push_messages_and_load_done_match_the_code() -> None:
    # The frames of a push message: request id 0, status ok, a map with `event`.
    frames = {row[0]: row[1] for row in table_at(_push_section(), "The server sends",
                                                  skip_prose=True)}
    notice = protocol.LoadDone(7, [protocol.LoadDoneItem("r", "", 1)])
    wire = protocol.push_frames(notice)
    assert protocol.PUSH_REQUEST_ID == 0 and wire[:2] == [bytes(8), protocol.STATUS_OK]
    assert wire[0].hex() in frames["0"] and "request id 0" in frames["0"]
    assert frames["1"].startswith(f"status: {protocol.STATUS_OK.decode()} ")
    assert "event (str)" in frames["2"]
    assert msgpack.unpackb(wire[2], raw=False)["event"] == "LOAD_DONE"

    # The LOAD_DONE and LOAD_PROGRESS tables are their messages, field for field, and
    # each message's `event` is its heading.
    for event, message in protocol.PUSH_MESSAGES.items():
        (lines,) = [lines for heading, lines in _subsections(_push_section()).items()
                    if heading == event]
        rows = table_at(lines, "**Fields**")
        assert [tuple(row[:2]) for row in rows] == [(path, tp) for path, tp, _ in
                                                    code_fields(message)]
        (event_row,) = [row for row in rows if row[0] == "event"]
        assert dataclasses.is_dataclass(message)
        assert message.__dataclass_fields__["event"].default == event
        assert f'"{event}"' in event_row[2]

    # Pushes exist now: nothing may say otherwise; and STATS documents `instances`.
    flat = re.sub(r"\s+", " ", DOC)
    assert "none yet" not in flat and "may appear in a later version" not in flat
    assert "recorded, no effect in version 1" not in flat
    assert "In version 1 a RETRIEVE writes only" not in flat
    stats_rows = [row[0] for row in table_at(doc_operations()["STATS"], "**Reply**")]
    assert "instances[].loads_pushed" in stats_rows


def _subsections(lines: list[str]) -> dict[str, list[str]]:
    headings = [i for i, line in enumerate(lines) if line.startswith("### ")]
    return {lines[start].removeprefix("### ").strip("`"): lines[start + 1:end]
            for start, end in zip(headings, [*headings[1:], len(lines)])}


def _mla_refusal_message(op: str, instance_id: int, tp_rank: int) -> str:
    """The refusal of a follower's STORE or RETRIEVE as the document quotes it."""
    (quoted,) = re.findall(r'"(under MLA only the TP leader[^"]*)"',
                           "\n".join(section("## Parallelism and MLA")))
    quoted = re.sub(r"\s+", " ", quoted)
    assert " sends STORE; instance N has tp_rank R," in quoted, quoted
    return quoted.replace(" sends STORE;", f" sends {op};").replace(
        " instance N ", f" instance {instance_id} ").replace(" tp_rank R,", f" tp_rank {tp_rank},")


@contextlib.contextmanager
def _connections(url: str, *names: str) -> Iterator[dict[str, zmq.Socket]]:
    """One DEALER per name, each with a fixed routing identity, as a registering client has;
    none has said HELLO yet."""
    context = zmq.Context()
    sockets: dict[str, zmq.Socket] = {}
    try:
        for name in names:
            sockets[name] = fixed_identity_dealer(
                context, url, f"lmcache-mp-{name}-".encode() + uuid.uuid4().bytes)
        yield sockets
    finally:
        for sock in sockets.values():
            sock.close()
        context.term()


def _nothing_more(*sockets: zmq.Socket, wait_ms: int = 300) -> None:
    time.sleep(wait_ms / 1000)
    for sock in sockets:
        assert not sock.poll(0), f"unexpected message: {sock.recv_multipart()}"


# The cache of the MLA example exchange: one layer [16, 128, 16] float16.
DOC_MLA = dict(layout="mla", num_layers=1, block_size=128, heads=1, head_dim=16,
               dtype=torch.float16)


def test_mla_example_exchange_replays_against_a_real_server() -> None:
    (block,) = fenced_blocks(section("### MLA example exchange"), "text")
    messages = parse_messages(block)
    assert {m[0] for m in messages} == {"leader", "follower"}
    # Request ids count from 1 on each connection, and each starts with HELLO under the
    # same engine secret.
    for name in ("leader", "follower"):
        sent = [m for m in messages if m[0] == name and m[1] == "C"]
        assert [m[2] for m in sent] == [rid(n) for n in range(1, len(sent) + 1)], name
        assert sent[0][3] == "HELLO" and sent[0][4]["engine"], name
    hellos = [m[4] for m in messages if m[1] == "C" and m[3] == "HELLO"]
    assert len({h["engine"] for h in hellos}) == 1
    # Exactly one push: LOAD_DONE to the follower, its fields in the table's order.
    (push,) = [m for m in messages if m[1] == "S" and m[2] == rid(0)]
    assert push[0] == "follower" and push[3] == "ok"
    load_done_rows = table_at(_subsections(_push_section())["LOAD_DONE"], "**Fields**")
    assert list(push[4]) == [row[0] for row in load_done_rows if "." not in row[0]]
    assert push[4]["event"] == "LOAD_DONE"
    # Every request gets its reply on its own connection, in order there.
    for name in ("leader", "follower"):
        own = [m for m in messages if m[0] == name and m[2] != rid(0)]
        assert [m[1] for m in own] == ["C", "S"] * (len(own) // 2)
        assert all(c[2] == s[2] for c, s in zip(own[0::2], own[1::2]))

    seed, num_blocks = 5, 16
    caches = {"leader": make_cache(num_blocks, seed, DOC_MLA),
              "follower": make_cache(num_blocks, None, DOC_MLA)}
    try:
        bound: dict[str, Any] = {}
        sent_ops: dict[tuple[str, bytes], str] = {}
        with running_server() as running, \
                _connections(running.url, "leader", "follower") as sockets:
            for connection, side, request_id, word, payload in messages:
                assert connection is not None, "each message here names its connection"
                sock = sockets[connection]
                if side == "C":
                    request = substitute(payload, bound)
                    if word == "REGISTER_KV_CACHE":
                        kv = caches[connection]
                        assert [dict(h, ticket=None, name=None) for h in request["layers"]] == \
                            [dict(dataclasses.asdict(h), ticket=None, name=None)
                             for h in kv.handles()]
                    sent_ops[connection, request_id] = word
                    sock.send_multipart([request_id, word.encode(),
                                         msgpack.packb(request, use_bin_type=True)])
                    continue
                assert sock.poll(REPLY_TIMEOUT_MS), f"nothing for the {connection}: {payload}"
                got_id, status, body = sock.recv_multipart()
                got = msgpack.unpackb(body, raw=False)
                assert (got_id, status.decode()) == (request_id, word), got
                op = sent_ops.get((connection, got_id), "push")
                check_reply(op, got, payload, bound)
                if got_id == rid(0):  # the push, field for field in the document's order
                    assert list(got) == list(push[4])
                if op == "HELLO":  # as the prose says: each rank trades its memfd for a ticket
                    bound[f"{connection}_ticket"] = ticket_for(got["fd_socket"], caches[connection],
                                                               got["fd_binding"])
            _nothing_more(*sockets.values())
            leader_id, follower_id = bound["leader_id"], bound["follower_id"]
            assert leader_id != follower_id

            # The follower's blocks 4..7 now hold the leader's blocks 0..3, byte for byte;
            # nothing else of its cache was written.
            follower = caches["follower"].blocks(list(range(num_blocks))).view(torch.uint8)
            source = expected_blocks(num_blocks, seed, [0, 1, 2, 3], DOC_MLA)
            assert follower[:, 4:8].equal(source)
            assert not follower[:, :4].any() and not follower[:, 8:].any()
            leader = caches["leader"].blocks([4, 5, 6, 7, 8, 9]).view(torch.uint8)
            assert leader[:, :4].equal(source)
            assert leader[:, 4:].equal(expected_blocks(num_blocks, seed, [8, 9], DOC_MLA))

            # The follower may not STORE or RETRIEVE: the document's message, nothing applied.
            store, retrieve = [m[4] for m in messages if m[0] == "leader" and m[1] == "C"
                               and m[3] in ("STORE", "RETRIEVE")]
            for n, op, request in ((10, "STORE", store), (11, "RETRIEVE", retrieve)):
                err = refused(sockets["follower"], n, op, substitute(
                    dict(request, instance_id=Placeholder("follower_id")), bound))
                assert err == {"code": "bad_request",
                               "message": _mla_refusal_message(op, follower_id, 1)}, op
            _nothing_more(*sockets.values())

            stats = call(sockets["leader"], 10, "STATS", {})
            counters = {i["instance_id"]: (i["tp_rank"], i["stores"], i["retrieves"],
                                           i["loads_pushed"]) for i in stats["instances"]}
            assert counters == {leader_id: (0, 1, 1, 0), follower_id: (1, 0, 0, 1)}
            assert stats["leases_held"] == 0
            for n, name in enumerate(("leader", "follower")):
                assert call(sockets[name], 20 + n, "UNREGISTER_KV_CACHE",
                            {"instance_id": bound[f"{name}_id"]}) == {}
    finally:
        for kv in caches.values():
            kv.close()


def test_an_mla_leaders_retrieve_lands_in_its_own_engines_followers_only() -> None:
    """A W3-like cache (tests/workers.MLA): two items, one salted, one partly stored; beside
    the group, a registration of another model and a look-alike of another engine."""
    num_blocks, seed, model = 12 * 16, 11, "w3-model"
    names = ("leader", "follower", "other", "intruder")
    caches = {"leader": make_cache(num_blocks, seed, MLA),
              **{name: make_cache(num_blocks, None, MLA) for name in names[1:]}}
    engines = {"leader": "engine-1", "follower": "engine-1", "other": "engine-1",
               "intruder": "engine-2"}

    def register(sock: zmq.Socket, n: int, name: str, model: str, tp_rank: int, path: str) -> int:
        return call(sock, n, "REGISTER_KV_CACHE", {
            "model": model, "kv_world_size": 1, "kv_worker_id": 0, "layout": "mla",
            "block_size": MLA["block_size"], "tp_rank": tp_rank,
            "layers": wire_handles(caches[name], path)})["instance_id"]

    def transfer(instance_id: int, *items: tuple[str, list[bytes], list[int], str]) -> dict:
        return {"instance_id": instance_id, "items": [
            {"request_id": request_id, "chunk_hashes": b"".join(hashes),
             "block_ids": struct.pack(f"<{len(blocks)}i", *blocks), "cache_salt": salt}
            for request_id, hashes, blocks, salt in items]}

    def blocks(name: str, slots: list[int]) -> torch.Tensor:
        return caches[name].blocks(chunk_blocks(slots)).view(torch.uint8)

    prompt_a, prompt_b = prompt(300, 3), prompt(301, 3)
    try:
        with running_server() as running, _connections(running.url, *names) as sockets:
            for name in names:
                hello(sockets[name], engine=engines[name])
            leader, follower, other, intruder = (sockets[name] for name in names)
            path = fd_socket(running)
            leader_id = register(leader, 1, "leader", model, 0, path)
            follower_id = register(follower, 1, "follower", model, 1, path)
            other_id = register(other, 1, "other", "other-model", 1, path)
            # The same model, tp_group, geometry and a follower's tp_rank, but another engine.
            intruder_id = register(intruder, 1, "intruder", model, 1, path)

            # A follower's STORE is refused with the documented message, and stores nothing.
            err = refused(follower, 2, "STORE", transfer(
                follower_id, ("f", prompt_a, chunk_blocks([0, 1, 2]), "")))
            assert err == {"code": "bad_request",
                           "message": _mla_refusal_message("STORE", follower_id, 1)}
            assert call(follower, 3, "LOOKUP", {"model": model, "kv_world_size": 1, "items": [
                {"request_id": "f", "chunk_hashes": b"".join(prompt_a)}]}) == {"hits": [0]}

            # The leader stores 3 chunks of prompt A and 2 of prompt B (under a salt).
            stored = protocol.StoreStatus.STORED
            assert call(leader, 2, "STORE", transfer(
                leader_id, ("w-a", prompt_a, chunk_blocks([0, 1, 2]), ""),
                ("w-b", prompt_b[:2], chunk_blocks([3, 4]), "team-a"))) == \
                {"results": [bytes([stored] * 3), bytes([stored] * 2)]}
            _nothing_more(follower, other, intruder, wait_ms=100)  # a STORE is not fanned out

            # The leader retrieves both into other blocks; B's third chunk is missing.
            assert call(leader, 3, "RETRIEVE", transfer(
                leader_id, ("gen-a", prompt_a, chunk_blocks([9, 8, 7]), ""),
                ("gen-b", prompt_b, chunk_blocks([10, 11, 6]), "team-a"))) == \
                {"retrieved": [3, 2]}
            assert follower.poll(REPLY_TIMEOUT_MS)
            got_id, status, body = follower.recv_multipart()
            assert (got_id, status) == (rid(0), b"ok")
            assert msgpack.unpackb(body, raw=False) == {
                "instance_id": follower_id,
                "items": [{"request_id": "gen-a", "cache_salt": "", "retrieved": 3, "load_seq": 0},
                          {"request_id": "gen-b", "cache_salt": "team-a", "retrieved": 2,
                           "load_seq": 0}],
                "event": "LOAD_DONE"}

            # Byte for byte in the follower (and the leader); nothing else was written.
            for name in ("leader", "follower"):
                assert blocks(name, [9, 8, 7]).equal(
                    expected_blocks(num_blocks, seed, chunk_blocks([0, 1, 2]), MLA)), name
                assert blocks(name, [10, 11]).equal(
                    expected_blocks(num_blocks, seed, chunk_blocks([3, 4]), MLA)), name
            assert blocks("leader", [6]).equal(
                expected_blocks(num_blocks, seed, chunk_blocks([6]), MLA))
            assert not blocks("follower", [0, 1, 2, 3, 4, 5, 6]).any()
            for name in ("other", "intruder"):
                assert not blocks(name, list(range(12))).any(), name

            # A RETRIEVE that finds nothing still tells the follower, with 0.
            assert call(leader, 4, "RETRIEVE", transfer(
                leader_id, ("gen-c", prompt(302, 1), chunk_blocks([5]), ""))) == {"retrieved": [0]}
            assert follower.poll(REPLY_TIMEOUT_MS)
            got_id, status, body = follower.recv_multipart()
            assert (got_id, status, msgpack.unpackb(body, raw=False)) == (rid(0), b"ok", {
                "instance_id": follower_id,
                "items": [{"request_id": "gen-c", "cache_salt": "", "retrieved": 0, "load_seq": 0}],
                "event": "LOAD_DONE"})

            # Nor may a follower RETRIEVE; the others got nothing, not even a push.
            err = refused(follower, 4, "RETRIEVE", transfer(
                follower_id, ("f", prompt_a, chunk_blocks([0, 1, 2]), "")))
            assert err == {"code": "bad_request",
                           "message": _mla_refusal_message("RETRIEVE", follower_id, 1)}
            _nothing_more(leader, follower, other, intruder)

            # STATS: the engine sees its own three registrations, the admin all four.
            expected = [
                {"instance_id": leader_id, "model": model, "kv_world_size": 1, "kv_worker_id": 0,
                 "tp_rank": 0, "stores": 1, "retrieves": 2, "loads_pushed": 0},
                {"instance_id": follower_id, "model": model, "kv_world_size": 1,
                 "kv_worker_id": 0, "tp_rank": 1, "stores": 0, "retrieves": 0, "loads_pushed": 2},
                {"instance_id": other_id, "model": "other-model", "kv_world_size": 1,
                 "kv_worker_id": 0, "tp_rank": 1, "stores": 0, "retrieves": 0, "loads_pushed": 0}]
            stats = call(leader, 5, "STATS", {})
            assert stats["registrations"] == 4
            assert stats["instances"] == expected
            with session(running, admin=True) as admin:
                assert call(admin, 1, "STATS", {})["instances"] == expected + [
                    {"instance_id": intruder_id, "model": model, "kv_world_size": 1,
                     "kv_worker_id": 0, "tp_rank": 1, "stores": 0, "retrieves": 0,
                     "loads_pushed": 0}]
            assert list(stats["instances"][0]) == [
                row[0].removeprefix("instances[].") for row in
                table_at(doc_operations()["STATS"], "**Reply**")
                if row[0].startswith("instances[].")]
            for name, instance_id in zip(names, (leader_id, follower_id, other_id, intruder_id)):
                assert call(sockets[name], 6, "UNREGISTER_KV_CACHE",
                            {"instance_id": instance_id}) == {}
    finally:
        for kv in caches.values():
            kv.close()
