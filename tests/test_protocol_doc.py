"""docs/protocol.md, checked against the code and a real server.

- the op, field, error-code, status-byte and dtype tables match lmcache_mp.protocol
  (nested fields too: `items[].x` for arrays of maps, `tenants{}.x` for maps of maps),
  and so do the push-message frames and the LOAD_DONE fields;
- the worked chunk-hash example matches lmcache_mp.client.chunk_hashes;
- the example exchange, replayed frame by frame against a fresh server, gets exactly
  the replies the document shows (and the KV bytes really move), with the
  `<instance_id>` placeholder bound to the id the server returned; so do the quota
  exchange that follows it (QUOTA_SET, LOOKUP, QUOTA_GET, QUOTA_LIST, QUOTA_DELETE)
  and the QUOTA_SET error examples;
- the quota model holds on a real server: the layers (default, --quota, --quota-file,
  QUOTA_SET), SIGHUP reloads, usage in 4096-byte units, OVER_QUOTA and STATS `tenants`;
- the MLA example exchange (a leader and a follower on two connections, with the
  follower's LOAD_DONE push) replays against a real server, and the MLA rules hold with
  a W3-like cache: only the leader stores and retrieves (the follower gets the documented
  bad_request), its RETRIEVE lands byte for byte in the follower's blocks and in no other
  cache, the follower is told with one LOAD_DONE per RETRIEVE, and STATS `instances`
  counts it all;
- the documented limits and validation rules hold, and a registration can only be
  used by the routing identity that made it (also after that identity reconnects);
- the example client, extracted from the document, runs against a real server and
  finds the chunks that lmcache_mp's own client stored;
- malformed frames get the error replies the document promises and the server keeps
  serving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import struct
import subprocess
import sys
import tempfile
import time
import types
import typing
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union

import msgpack
import pytest
import torch
import zmq

from lmcache_mp import errors, protocol
from lmcache_mp.client import CacheClient, SharedKVCache, TransferItem, chunk_hashes
from lmcache_mp.client.hashing import HASH_SEED
from lmcache_mp.server.dispatcher import MAX_REQUEST_ID_CHARS
from lmcache_mp.server.pool import ALIGNMENT, aligned
from lmcache_mp.server.registry import DTYPES, MAX_KV_WORLD_SIZE, MAX_LAYERS

from .workers import MLA, chunk_blocks, expected_blocks, make_cache, prompt

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
DOC = DOC_PATH.read_text(encoding="utf-8")
DOC_LINES = DOC.splitlines()

REPLY_TIMEOUT_MS = 10_000
SERVER_START_TIMEOUT_MS = 60_000


# ---------------------------------------------------------------------------
# Reading the document.

def section(heading: str) -> list[str]:
    """The lines after `heading` (an exact line) up to the next heading of the same or higher level."""
    start = DOC_LINES.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    end, in_fence = len(DOC_LINES), False
    for i in range(start + 1, len(DOC_LINES)):
        line = DOC_LINES[i]
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#") and not line.startswith("#" * (level + 1)):
            end = i
            break
    return DOC_LINES[start + 1:end]


def fenced_blocks(lines: list[str], language: str) -> list[str]:
    blocks, current = [], None
    for line in lines:
        if current is None and line.strip() == f"```{language}":
            current = []
        elif current is not None and line.strip() == "```":
            blocks.append("\n".join(current) + "\n")
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def table_after(lines: list[str], marker: str, skip_prose: bool = False) -> list[list[str]] | None:
    """Rows (cells stripped of backticks) of the table right after the line starting with `marker`.

    None if something else comes first; with skip_prose, the first table after the marker.
    """
    i = next(i for i, line in enumerate(lines) if line.startswith(marker)) + 1
    while i < len(lines) and (not lines[i].strip() or (skip_prose and not lines[i].startswith("|"))):
        i += 1
    if i == len(lines) or not lines[i].startswith("|"):
        return None
    rows = []
    while i < len(lines) and lines[i].startswith("|"):
        rows.append([cell.strip().replace("`", "") for cell in lines[i].strip().strip("|").split("|")])
        i += 1
    header, separator, *body = rows
    assert set("".join(separator)) <= set("- "), f"not a table separator: {separator}"
    return body


def doc_operations() -> dict[str, list[str]]:
    ops, lines = {}, section("## Operations")
    headings = [i for i, line in enumerate(lines) if line.startswith("### ")]
    for start, end in zip(headings, [*headings[1:], len(lines)]):
        ops[lines[start].removeprefix("### ").strip("`")] = lines[start + 1:end]
    return ops


# ---------------------------------------------------------------------------
# What the code says the tables must contain.

def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = [arg for arg in typing.get_args(tp) if arg is not type(None)]
        if len(options) > 1:  # a tagged union of maps, documented kind by kind
            assert all(dataclasses.is_dataclass(o) for o in options)
            return "map"
        return f"{type_name(options[0])} or nil"
    if origin is list:
        (item,) = typing.get_args(tp)
        return f"array of {type_name(item)}"
    if origin is dict:
        key, value = typing.get_args(tp)
        return f"map of {type_name(key)} → {type_name(value)}"
    if dataclasses.is_dataclass(tp):
        return "map"
    return {int: "int", float: "float", str: "str", bool: "bool", bytes: "bin"}[tp]


def default_text(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "required"
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(value, bytes):
        return f'hex"{value.hex()}"'
    return "nil" if value is None else json.dumps(value)


def code_fields(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(path, type, default) of every field.

    Nested fields: of a list of maps as `name[].field`, of a map of maps as `name{}.field`.
    """
    hints = typing.get_type_hints(cls, vars(protocol))
    rows = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        rows.append((prefix + f.name, type_name(tp), default_text(f)))
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            rows.extend(code_fields(typing.get_args(tp)[0], f"{prefix}{f.name}[]."))
        if typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
            rows.extend(code_fields(typing.get_args(tp)[1], f"{prefix}{f.name}{{}}."))
    return rows


# ---------------------------------------------------------------------------
# The example-exchange notation: `C: [hex id] [OP]` / `S: [hex id] [status]`, then
# the payload as JSON where hex"..." is a msgpack bin and <name> is a placeholder for a
# value the server chooses (bound from the reply it first appears in).

_MESSAGE_LINE = re.compile(r"^(?:([a-z]+) )?([CS]): \[([0-9a-f]{16})\] \[([A-Za-z_]+)\]$")
_HEX = re.compile(r'hex"([0-9a-f]*)"')
_PLACEHOLDER = re.compile(r"<([a-z_]+)>")


@dataclasses.dataclass(frozen=True)
class Placeholder:
    name: str


def parse_payload(text: str) -> Any:
    def restore(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {"$hex"}:
                return bytes.fromhex(value["$hex"])
            if set(value) == {"$placeholder"}:
                return Placeholder(value["$placeholder"])
            return {k: restore(v) for k, v in value.items()}
        if isinstance(value, list):
            return [restore(v) for v in value]
        return value
    text = _HEX.sub(lambda m: json.dumps({"$hex": m.group(1)}), text)
    text = _PLACEHOLDER.sub(lambda m: json.dumps({"$placeholder": m.group(1)}), text)
    return restore(json.loads(text))


def substitute(value: Any, bound: dict[str, Any]) -> Any:
    """`value` with every placeholder replaced by its bound value (all must be bound)."""
    if isinstance(value, Placeholder):
        assert value.name in bound, f"<{value.name}> is used before a reply defined it"
        return bound[value.name]
    if isinstance(value, dict):
        return {k: substitute(v, bound) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, bound) for v in value]
    return value


def bind(expected: Any, got: Any, bound: dict[str, Any]) -> Any:
    """`expected` with its placeholders bound to what `got` has in their place."""
    if isinstance(expected, Placeholder):
        if expected.name not in bound:
            bound[expected.name] = got
        return bound[expected.name]
    if isinstance(expected, dict) and isinstance(got, dict):
        return {k: bind(v, got.get(k), bound) for k, v in expected.items()}
    if isinstance(expected, list) and isinstance(got, list) and len(expected) == len(got):
        return [bind(e, g, bound) for e, g in zip(expected, got)]
    return expected


def parse_messages(block: str) -> list[tuple[str | None, str, bytes, str, Any]]:
    """(connection, side, request id, op or status, payload) per message.

    The connection is the word before `C:`/`S:` (`leader C: ...`), None where there is none.
    """
    messages: list[tuple[str | None, str, bytes, str, list[str]]] = []
    for line in block.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = _MESSAGE_LINE.match(line)
        if match:
            connection, side, request_id, word = match.groups()
            messages.append((connection, side, bytes.fromhex(request_id), word, []))
        else:
            assert messages and line.startswith("   "), f"unexpected line in the exchange: {line!r}"
            messages[-1][4].append(line)
    return [(connection, side, rid, word, parse_payload("\n".join(body)))
            for connection, side, rid, word, body in messages]


def parse_exchange(block: str) -> list[tuple[str, bytes, str, Any]]:
    """An exchange on one connection: (side, request id, op or status, payload) per message."""
    messages = parse_messages(block)
    assert {m[0] for m in messages} <= {None}, "this exchange must not name connections"
    return [m[1:] for m in messages]


# ---------------------------------------------------------------------------
# A real server.

@dataclasses.dataclass
class RunningServer:
    url: str
    process: subprocess.Popen


SERVER_CPU_SIZE = "64MiB"  # the pool of every server these tests start


@contextlib.contextmanager
def running_server(*args: str) -> Iterator[RunningServer]:
    """`python -m lmcache_mp.server` on a fresh ipc socket; SIGTERM at the end must exit 0."""
    path = f"/tmp/lmcache_mp_doc_{os.getpid()}_{uuid.uuid4().hex[:8]}.sock"
    url = f"ipc://{path}"
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "lmcache_mp.server", "--url", url, "--cpu-size", SERVER_CPU_SIZE,
             "--log-level", "warning", *args], stdout=log, stderr=subprocess.STDOUT)
        try:
            with dealer(url) as sock:
                sock.send_multipart([struct.pack("<Q", 1), b"PING", msgpack.packb({})])
                answered = sock.poll(SERVER_START_TIMEOUT_MS)
                assert answered, f"the server at {url} did not answer PING (exit code {process.poll()})"
                assert sock.recv_multipart()[1] == b"ok"
            yield RunningServer(url, process)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                code = None
            log.seek(0)
            output = log.read().decode(errors="replace")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        assert code == 0, f"server exit code {code} after SIGTERM; its output:\n{output}"


@contextlib.contextmanager
def dealer(url: str) -> Iterator[zmq.Socket]:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    try:
        yield sock
    finally:
        sock.close()
        context.term()


def exchange(sock: zmq.Socket, frames: list[bytes]) -> tuple[bytes, bytes, Any]:
    sock.send_multipart(frames)
    assert sock.poll(REPLY_TIMEOUT_MS), f"no reply to {frames[:2]}"
    reply = sock.recv_multipart()
    assert len(reply) == 3, reply
    return reply[0], reply[1], msgpack.unpackb(reply[2], raw=False)


def rid(n: int) -> bytes:
    return struct.pack("<Q", n)


def call(sock: zmq.Socket, n: int, op: str, payload: dict[str, Any]) -> Any:
    """Send one request; return the payload of its `ok` reply (an `err` reply fails the test)."""
    got_id, status, reply = exchange(sock, [rid(n), op.encode(), msgpack.packb(payload)])
    assert (got_id, status) == (rid(n), b"ok"), (op, payload, reply)
    return reply


def replay(sock: zmq.Socket, messages: list[tuple[str, bytes, str, Any]]) -> None:
    """Send each `C:` message and check that the reply is exactly the `S:` message after it."""
    assert [m[0] for m in messages] == ["C", "S"] * (len(messages) // 2)
    for (_, request_id, op, request), (_, reply_id, status, expected) in zip(
            messages[0::2], messages[1::2]):
        assert reply_id == request_id
        got_id, got_status, got = exchange(
            sock, [request_id, op.encode(), msgpack.packb(request, use_bin_type=True)])
        assert (got_id, got_status.decode(), got) == (request_id, status, expected), op


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server() as running:
        yield running


# ---------------------------------------------------------------------------
# The tables.

def test_every_op_is_documented_with_its_exact_fields() -> None:
    documented = doc_operations()
    assert list(documented) == list(protocol.OPS)
    for op, spec in protocol.OPS.items():
        lines = documented[op]
        request_rows = table_after(lines, "**Request**") or []
        reply_rows = table_after(lines, "**Reply**") or []
        assert [tuple(row[:3]) for row in request_rows] == code_fields(spec.request), op
        assert [tuple(row[:2]) for row in reply_rows] == \
            [(path, tp) for path, tp, _ in code_fields(spec.reply)], op


def test_every_handle_kind_is_documented_with_its_exact_fields() -> None:
    lines = section("## KV cache handles and layouts")
    for cls in typing.get_args(protocol.TensorHandle):
        rows = table_after(lines, f"**`{cls.KIND}` handle**", skip_prose=True)
        assert [tuple(row[:3]) for row in rows] == code_fields(cls), cls.KIND
    (layers_row,) = [row for row in table_after(doc_operations()["REGISTER_KV_CACHE"],
                                                "**Request**") if row[0] == "layers"]
    assert all(f"{cls.KIND} handle" in layers_row[3] for cls in typing.get_args(protocol.TensorHandle))


def test_error_codes_status_bytes_and_dtypes_match_the_code() -> None:
    codes = [row[0] for row in table_after(section("## Errors"), "An `err` reply", skip_prose=True)]
    assert sorted(codes) == sorted(errors.ERROR_CLASSES)
    assert protocol.ErrorReply.__annotations__ == {"code": "str", "message": "str"}

    statuses = {int(row[0]): row[1] for row in table_after(doc_operations()["STORE"], "Status bytes")}
    expected = {value: name for name, value in vars(protocol.StoreStatus).items()
                if not name.startswith("_")}
    assert statuses == expected
    assert expected[4] == "OVER_QUOTA"
    # Quotas exist now: nothing may say otherwise.
    assert not re.search(r"no per-salt\s+quotas?", DOC) and "no quotas" not in DOC

    (dtype_line,) = [line for line in DOC_LINES if line.startswith("Accepted `dtype` names:")]
    assert re.findall(r"`([a-z0-9_]+)`", dtype_line.split(":", 1)[1]) == list(DTYPES)

    assert "# The lmcache-mp wire protocol, version 1" == DOC_LINES[0]
    assert protocol.PROTOCOL_VERSION == 1


# ---------------------------------------------------------------------------
# The worked hash example.

def test_worked_hash_example_matches_chunk_hashes() -> None:
    (block,) = fenced_blocks(section("### Worked example"), "text")
    values = dict(re.findall(r"^(seed|hash\[\d\])\s*=\s*([0-9a-f]{32})$", block, re.MULTILINE))
    assert values["seed"] == HASH_SEED.hex()
    assert [values["hash[0]"], values["hash[1]"]] == [h.hex() for h in chunk_hashes(list(range(512)), 256)]
    assert [values[f"hash[{i}]"] for i in range(3)] == \
        [h.hex() for h in chunk_hashes(list(range(768)), 256)]


# ---------------------------------------------------------------------------
# The example exchange, replayed.

def test_example_exchange_replays_against_a_real_server() -> None:
    blocks = fenced_blocks(section("## Example exchange"), "text")
    assert len(blocks) == 3
    messages = [m for block in blocks for m in parse_exchange(block)]
    assert [m[0] for m in messages] == ["C", "S"] * (len(messages) // 2)
    assert [m[2] for m in messages[0::2]][:5] == \
        ["HELLO", "REGISTER_KV_CACHE", "STORE", "LOOKUP", "RETRIEVE"]
    quota_messages = parse_exchange(blocks[1])
    assert [m[2] for m in quota_messages[0::2]] == \
        ["QUOTA_SET", "LOOKUP", "QUOTA_GET", "QUOTA_LIST", "QUOTA_DELETE"]
    # "a cap of one chunk": the cap is the chunk_bytes the registration reported.
    register_reply = next(m[3] for m in messages if m[0] == "S" and "chunk_bytes" in m[3])
    assert quota_messages[0][3]["cap"] == register_reply["chunk_bytes"]
    # Request ids count up from 1 over the whole exchange.
    assert [m[1] for m in messages[0::2]] == [rid(n) for n in range(1, len(messages) // 2 + 1)]

    kv = SharedKVCache("mha", num_layers=2, num_blocks=16, block_size=128, heads=1, head_dim=8)
    try:
        # Distinct contents per block, so that a block landing in the wrong place shows.
        for i in range(len(kv.layers)):
            kv.layers[i].copy_(kv.layers[i].new_empty(kv.layers[i].shape).normal_())
        before = kv.blocks(list(range(16)))
        bound: dict[str, Any] = {}
        with running_server() as running, dealer(running.url) as sock:
            for (_, request_id, op, request), (_, reply_id, status, expected) in zip(
                    messages[0::2], messages[1::2]):
                assert reply_id == request_id
                request = substitute(request, bound)
                if op == "REGISTER_KV_CACHE":
                    assert [dict(h, name=None) for h in request["layers"]] == \
                        [dict(dataclasses.asdict(h), name=None) for h in kv.handles()]
                    request["layers"] = [dict(h, name=kv.name) for h in request["layers"]]
                    # The id is the server's choice: the document must not show a literal one.
                    assert expected["instance_id"] == Placeholder("instance_id")
                got_id, got_status, got = exchange(
                    sock, [request_id, op.encode(), msgpack.packb(request, use_bin_type=True)])
                assert (got_id, got_status.decode()) == (request_id, status), got
                if op == "HELLO":
                    assert isinstance(got.pop("server_version"), str)
                    expected = {k: v for k, v in expected.items() if k != "server_version"}
                expected = bind(expected, got, bound)
                assert got == expected, op
            instance_id = bound["instance_id"]
            assert type(instance_id) is int and 1 <= instance_id < 2**53, instance_id
        after = kv.blocks(list(range(16)))
        # RETRIEVE put chunks 0-1 (blocks 0-3) into blocks 4-7 and wrote nothing else.
        assert after[:, :, 4:8].equal(before[:, :, 0:4])
        assert after[:, :, :4].equal(before[:, :, :4])
        assert after[:, :, 8:].equal(before[:, :, 8:])
    finally:
        kv.close()


def test_a_batch_is_validated_before_anything_is_applied(server: RunningServer) -> None:
    kv = SharedKVCache("mha", num_layers=1, num_blocks=8, block_size=128, heads=1, head_dim=8)
    try:
        handles = [dataclasses.asdict(h) for h in kv.handles()]
        hashes = chunk_hashes(list(range(1000, 1512)), 256)
        with dealer(server.url) as sock:
            _, status, reg = exchange(sock, [rid(1), b"REGISTER_KV_CACHE", msgpack.packb({
                "model": "batch-model", "kv_world_size": 1, "kv_worker_id": 0, "layout": "mha",
                "block_size": 128, "layers": handles})])
            assert status == b"ok", reg
            good = {"request_id": "a", "chunk_hashes": hashes[0], "block_ids": struct.pack("<2i", 0, 1)}
            bad = {"request_id": "b", "chunk_hashes": hashes[1], "block_ids": struct.pack("<2i", 2, 99)}
            _, status, err = exchange(sock, [rid(2), b"STORE", msgpack.packb(
                {"instance_id": reg["instance_id"], "items": [good, bad]})])
            assert (status, err["code"]) == (b"err", "bad_request")
            assert "items[1].block_ids" in err["message"]
            lookup = {"model": "batch-model", "kv_world_size": 1,
                      "items": [{"request_id": "c", "chunk_hashes": hashes[0]}]}
            assert exchange(sock, [rid(3), b"LOOKUP", msgpack.packb(lookup)])[2] == {"hits": [0]}
            _, status, reply = exchange(sock, [rid(4), b"STORE", msgpack.packb(
                {"instance_id": reg["instance_id"], "items": [good]})])
            assert (status, reply) == (b"ok", {"results": [bytes([protocol.StoreStatus.STORED])]})
            assert exchange(sock, [rid(5), b"LOOKUP", msgpack.packb(lookup)])[2] == {"hits": [1]}
            assert exchange(sock, [rid(6), b"UNREGISTER_KV_CACHE", msgpack.packb(
                {"instance_id": reg["instance_id"]})])[1:] == (b"ok", {})
    finally:
        kv.close()


# ---------------------------------------------------------------------------
# Quotas.

def test_quota_set_error_examples_replay_against_a_real_server() -> None:
    lines = doc_operations()["QUOTA_SET"]
    (block,) = fenced_blocks(lines, "text")
    messages = parse_exchange(block)
    assert {m[2] for m in messages[0::2]} == {"QUOTA_SET"}
    assert {(m[2], m[3]["code"]) for m in messages[1::2]} == {("err", "bad_request")}
    # The examples name the pool size they were made on: the one these servers have.
    assert f"started with `--cpu-size {SERVER_CPU_SIZE}`" in " ".join(lines)
    with running_server() as running, dealer(running.url) as sock:
        replay(sock, messages)
        # Nothing was applied.
        assert call(sock, 100, "QUOTA_LIST", {}) == {"default_cap": None, "quotas": []}
        assert call(sock, 101, "STATS", {})["capacity_bytes"] == 64 * 1024**2


def _mla_cache() -> SharedKVCache:
    """An MLA cache whose chunk_bytes (1 layer x 256 tokens x 9 x 2 bytes = 4608) is not aligned."""
    return SharedKVCache("mla", num_layers=1, num_blocks=16, block_size=128, heads=1, head_dim=9)


def _quota(salt: str, cap: int | None, reserve: int, own: bool, used: int) -> dict[str, Any]:
    return {"cache_salt": salt, "cap": cap, "reserve": reserve, "own": own, "bytes_used": used}


def test_the_quota_model_holds_on_a_real_server(tmp_path: Path) -> None:
    """Layers, usage in 4096-byte units, caps, OVER_QUOTA, SIGHUP and STATS `tenants`."""
    quotas_section = re.sub(r"\s+", " ", " ".join(section("## Quotas")))
    assert ALIGNMENT == 4096 and f"multiple of {ALIGNMENT} bytes" in quotas_section
    assert aligned(16384) == 16384 and aligned(10000) == 12288
    assert "A chunk of 16384 bytes counts 16384, one of 10000 bytes counts 12288" in quotas_section
    for flag in ("--default-quota", "--quota", "--quota-file", "SIGHUP"):
        assert flag in quotas_section, flag
    KiB, MiB = 1024, 1024**2
    quota_file = tmp_path / "quotas.toml"
    quota_file.write_text('[quotas]\n"team-f" = "32KiB"\n"team-r" = {cap = "unlimited", '
                          'reserve = "1MiB"}\n')
    kv = _mla_cache()
    try:
        with running_server("--default-quota", "1MiB", "--quota", "team-a=64KiB:16KiB",
                            "--quota", "team-f=2MiB", "--quota-file", str(quota_file)) as running, \
                dealer(running.url) as sock:
            # Layers: the file wins over the flags; salts nobody names get the default.
            assert call(sock, 1, "QUOTA_LIST", {}) == {"default_cap": MiB, "quotas": [
                _quota("team-a", 64 * KiB, 16 * KiB, True, 0),
                _quota("team-f", 32 * KiB, 0, True, 0),
                _quota("team-r", None, MiB, True, 0)]}
            assert call(sock, 2, "QUOTA_GET", {"cache_salt": "nobody"}) == \
                _quota("nobody", MiB, 0, False, 0)
            # QUOTA_SET is the top layer; QUOTA_DELETE removes only it.
            assert call(sock, 3, "QUOTA_SET", {"cache_salt": "team-a", "cap": None}) == \
                _quota("team-a", None, 0, True, 0)
            assert call(sock, 4, "QUOTA_DELETE", {"cache_salt": "team-a"}) == \
                _quota("team-a", 64 * KiB, 16 * KiB, True, 0)
            assert call(sock, 5, "QUOTA_DELETE", {"cache_salt": "team-a"}) == \
                _quota("team-a", 64 * KiB, 16 * KiB, True, 0)
            assert call(sock, 6, "QUOTA_SET", {"cache_salt": "nobody", "cap": 0, "reserve": 0}) \
                == _quota("nobody", 0, 0, True, 0)
            assert call(sock, 7, "QUOTA_DELETE", {"cache_salt": "nobody"}) == \
                _quota("nobody", MiB, 0, False, 0)

            # Usage: 4608-byte chunks count 8192 bytes each, so a 32 KiB cap takes 4 of them;
            # the fifth chunk of the same STORE cannot evict chunks being stored: OVER_QUOTA.
            reg = call(sock, 8, "REGISTER_KV_CACHE", {
                "model": "quota-model", "kv_world_size": 1, "kv_worker_id": 0, "layout": "mla",
                "block_size": 128, "layers": [dataclasses.asdict(h) for h in kv.handles()]})
            assert reg["chunk_bytes"] == 4608
            footprint = 8192
            hashes = chunk_hashes(list(range(256 * 6)), 256)

            def store(n: int, first: int, count: int) -> bytes:
                reply = call(sock, n, "STORE", {"instance_id": reg["instance_id"], "items": [{
                    "request_id": "w", "chunk_hashes": b"".join(hashes[first:first + count]),
                    "block_ids": struct.pack(f"<{2 * count}i", *range(2 * count)),
                    "cache_salt": "team-f"}]})
                (statuses,) = reply["results"]
                return statuses

            S = protocol.StoreStatus
            assert store(9, 0, 5) == bytes([S.STORED] * 4 + [S.OVER_QUOTA])
            assert call(sock, 10, "QUOTA_GET", {"cache_salt": "team-f"}) == \
                _quota("team-f", 32 * KiB, 0, True, 4 * footprint)
            # A later chunk evicts the salt's own least recently used chunk instead.
            assert store(11, 5, 1) == bytes([S.STORED])
            lookup = {"model": "quota-model", "kv_world_size": 1, "items": [
                {"request_id": "q", "chunk_hashes": b"".join(hashes), "cache_salt": "team-f"}]}
            # A STORE commits its last chunk first, so chunk 3 was the oldest: it went.
            assert call(sock, 12, "LOOKUP", lookup) == {"hits": [3]}

            stats = call(sock, 13, "STATS", {})
            assert stats["tenants"]["team-f"] == {
                "bytes_used": 4 * footprint, "chunks": 4, "cap": 32 * KiB, "reserve": 0,
                "hits": 3, "misses": 3, "evictions": 1, "refused": 1}
            # "nobody" was only looked up: it holds nothing and has no quota, so it is not listed.
            assert set(stats["tenants"]) == {"team-a", "team-f", "team-r"}
            assert stats["tenants"]["team-r"] == {
                "bytes_used": 0, "chunks": 0, "cap": None, "reserve": MiB, "hits": 0,
                "misses": 0, "evictions": 0, "refused": 0}
            for total in ("chunks", "bytes_used"):
                assert stats[total] == sum(t[total] for t in stats["tenants"].values()), total
            for total in ("hits", "misses", "evictions"):  # unlisted salts count here too
                assert stats[total] >= sum(t[total] for t in stats["tenants"].values()), total

            # SIGHUP reloads the file as a whole; a lower cap evicts at once.
            quota_file.write_text('[quotas]\n"team-f" = "16KiB"\n')
            running.process.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while (info := call(sock, 14, "QUOTA_GET", {"cache_salt": "team-f"}))["cap"] != 16 * KiB:
                assert time.monotonic() < deadline, info
                time.sleep(0.05)
            assert info == _quota("team-f", 16 * KiB, 0, True, 2 * footprint)
            assert call(sock, 15, "QUOTA_GET", {"cache_salt": "team-r"}) == \
                _quota("team-r", MiB, 0, False, 0)  # gone from the file: the default again
            # A file that breaks the rules changes nothing.
            quota_file.write_text('[quotas]\n"team-f" = "1MiB:2MiB"\n')
            running.process.send_signal(signal.SIGHUP)
            time.sleep(0.5)
            assert call(sock, 16, "QUOTA_GET", {"cache_salt": "team-f"})["cap"] == 16 * KiB
            # Without the file's entry, the flag's quota applies again.
            quota_file.write_text("[quotas]\n")
            running.process.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while call(sock, 17, "QUOTA_GET", {"cache_salt": "team-f"})["cap"] != 2 * MiB:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert call(sock, 18, "UNREGISTER_KV_CACHE", {"instance_id": reg["instance_id"]}) == {}
    finally:
        kv.close()


# ---------------------------------------------------------------------------
# MLA and push messages.

def _push_section() -> list[str]:
    return section("## Push messages")


def test_push_messages_and_load_done_match_the_code() -> None:
    # The frames of a push message: request id 0, status ok, a map with `event`.
    frames = {row[0]: row[1] for row in table_after(_push_section(), "The server sends",
                                                     skip_prose=True)}
    notice = protocol.LoadDone(7, [protocol.LoadDoneItem("r", "", 1)])
    wire = protocol.push_frames(notice)
    assert protocol.PUSH_REQUEST_ID == 0 and wire[:2] == [bytes(8), protocol.STATUS_OK]
    assert wire[0].hex() in frames["0"] and "request id 0" in frames["0"]
    assert frames["1"].startswith(f"status: {protocol.STATUS_OK.decode()} ")
    assert "event (str)" in frames["2"]
    assert msgpack.unpackb(wire[2], raw=False)["event"] == "LOAD_DONE"

    # The LOAD_DONE table is the LoadDone message, field for field.
    (load_done,) = [lines for heading, lines in _subsections(_push_section()).items()
                    if heading == "LOAD_DONE"]
    rows = table_after(load_done, "**Fields**")
    assert [tuple(row[:2]) for row in rows] == [(path, tp) for path, tp, _ in
                                                code_fields(protocol.LoadDone)]
    (event_row,) = [row for row in rows if row[0] == "event"]
    assert f'"{protocol.LoadDone.__dataclass_fields__["event"].default}"' in event_row[2]

    # Pushes exist now: nothing may say otherwise; and STATS documents `instances`.
    flat = re.sub(r"\s+", " ", DOC)
    assert "none yet" not in flat and "may appear in a later version" not in flat
    assert "recorded, no effect in version 1" not in flat
    assert "In version 1 a RETRIEVE writes only" not in flat
    stats_rows = [row[0] for row in table_after(doc_operations()["STATS"], "**Reply**")]
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
    """One DEALER per name, each with a fixed routing identity, as a registering client has."""
    context = zmq.Context()
    sockets: dict[str, zmq.Socket] = {}
    try:
        for name in names:
            sockets[name] = _fixed_identity_dealer(
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
    # Request ids count from 1 on each connection.
    for name in ("leader", "follower"):
        sent = [m[2] for m in messages if m[0] == name and m[1] == "C"]
        assert sent == [rid(n) for n in range(1, len(sent) + 1)], name
    # Exactly one push: LOAD_DONE to the follower, its fields in the table's order.
    (push,) = [m for m in messages if m[1] == "S" and m[2] == rid(0)]
    assert push[0] == "follower" and push[3] == "ok"
    load_done_rows = table_after(_subsections(_push_section())["LOAD_DONE"], "**Fields**")
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
        with running_server() as running, \
                _connections(running.url, "leader", "follower") as sockets:
            for connection, side, request_id, word, payload in messages:
                sock = sockets[connection]
                if side == "C":
                    request = substitute(payload, bound)
                    if word == "REGISTER_KV_CACHE":
                        kv = caches[connection]
                        assert [dict(h, name=None) for h in request["layers"]] == \
                            [dict(dataclasses.asdict(h), name=None) for h in kv.handles()]
                        request["layers"] = [dict(h, name=kv.name) for h in request["layers"]]
                    sock.send_multipart([request_id, word.encode(),
                                         msgpack.packb(request, use_bin_type=True)])
                    continue
                assert sock.poll(REPLY_TIMEOUT_MS), f"nothing for the {connection}: {payload}"
                got_id, status, body = sock.recv_multipart()
                got = msgpack.unpackb(body, raw=False)
                assert (got_id, status.decode()) == (request_id, word), got
                assert got == bind(payload, got, bound), (connection, payload)
                if got_id == rid(0):  # the push, field for field in the document's order
                    assert list(got) == list(push[4])
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
                _, status, err = exchange(sockets["follower"], [rid(n), op.encode(), msgpack.packb(
                    substitute(dict(request, instance_id=Placeholder("follower_id")), bound))])
                assert (status, err) == (b"err", {
                    "code": "bad_request",
                    "message": _mla_refusal_message(op, follower_id, 1)}), op
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


def test_an_mla_leaders_retrieve_lands_in_its_followers_only() -> None:
    """A W3-like cache (tests/workers.MLA): two items, one salted, one partly stored."""
    num_blocks, seed, model = 12 * 16, 11, "w3-model"
    caches = {"leader": make_cache(num_blocks, seed, MLA),
              "follower": make_cache(num_blocks, None, MLA),
              "other": make_cache(num_blocks, None, MLA)}  # another model: not in the group

    def register(sock: zmq.Socket, n: int, name: str, model: str, tp_rank: int) -> int:
        return call(sock, n, "REGISTER_KV_CACHE", {
            "model": model, "kv_world_size": 1, "kv_worker_id": 0, "layout": "mla",
            "block_size": MLA["block_size"], "tp_rank": tp_rank,
            "layers": [dataclasses.asdict(h) for h in caches[name].handles()]})["instance_id"]

    def transfer(instance_id: int, *items: tuple[str, list[bytes], list[int], str]) -> dict:
        return {"instance_id": instance_id, "items": [
            {"request_id": request_id, "chunk_hashes": b"".join(hashes),
             "block_ids": struct.pack(f"<{len(blocks)}i", *blocks), "cache_salt": salt}
            for request_id, hashes, blocks, salt in items]}

    def blocks(name: str, slots: list[int]) -> torch.Tensor:
        return caches[name].blocks(chunk_blocks(slots)).view(torch.uint8)

    prompt_a, prompt_b = prompt(300, 3), prompt(301, 3)
    try:
        with running_server() as running, \
                _connections(running.url, "leader", "follower", "other") as sockets:
            leader, follower, other = sockets["leader"], sockets["follower"], sockets["other"]
            leader_id = register(leader, 1, "leader", model, 0)
            follower_id = register(follower, 1, "follower", model, 1)
            other_id = register(other, 1, "other", "other-model", 1)

            # A follower's STORE is refused with the documented message, and stores nothing.
            _, status, err = exchange(follower, [rid(2), b"STORE", msgpack.packb(transfer(
                follower_id, ("f", prompt_a, chunk_blocks([0, 1, 2]), "")))])
            assert (status, err) == (b"err", {
                "code": "bad_request", "message": _mla_refusal_message("STORE", follower_id, 1)})
            assert call(follower, 3, "LOOKUP", {"model": model, "kv_world_size": 1, "items": [
                {"request_id": "f", "chunk_hashes": b"".join(prompt_a)}]}) == {"hits": [0]}

            # The leader stores 3 chunks of prompt A and 2 of prompt B (under a salt).
            stored = protocol.StoreStatus.STORED
            assert call(leader, 2, "STORE", transfer(
                leader_id, ("w-a", prompt_a, chunk_blocks([0, 1, 2]), ""),
                ("w-b", prompt_b[:2], chunk_blocks([3, 4]), "team-a"))) == \
                {"results": [bytes([stored] * 3), bytes([stored] * 2)]}
            _nothing_more(follower, other, wait_ms=100)  # a STORE is not fanned out

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
                "items": [{"request_id": "gen-a", "cache_salt": "", "retrieved": 3},
                          {"request_id": "gen-b", "cache_salt": "team-a", "retrieved": 2}],
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
            assert not blocks("other", list(range(12))).any()

            # A RETRIEVE that finds nothing still tells the follower, with 0.
            assert call(leader, 4, "RETRIEVE", transfer(
                leader_id, ("gen-c", prompt(302, 1), chunk_blocks([5]), ""))) == {"retrieved": [0]}
            assert follower.poll(REPLY_TIMEOUT_MS)
            got_id, status, body = follower.recv_multipart()
            assert (got_id, status, msgpack.unpackb(body, raw=False)) == (rid(0), b"ok", {
                "instance_id": follower_id,
                "items": [{"request_id": "gen-c", "cache_salt": "", "retrieved": 0}],
                "event": "LOAD_DONE"})

            # Nor may a follower RETRIEVE; the registration of another model got nothing.
            _, status, err = exchange(follower, [rid(4), b"RETRIEVE", msgpack.packb(transfer(
                follower_id, ("f", prompt_a, chunk_blocks([0, 1, 2]), "")))])
            assert (status, err) == (b"err", {
                "code": "bad_request",
                "message": _mla_refusal_message("RETRIEVE", follower_id, 1)})
            _nothing_more(leader, follower, other)

            stats = call(leader, 5, "STATS", {})
            assert stats["registrations"] == 3
            assert stats["instances"] == [
                {"instance_id": leader_id, "model": model, "kv_world_size": 1, "kv_worker_id": 0,
                 "tp_rank": 0, "stores": 1, "retrieves": 2, "loads_pushed": 0},
                {"instance_id": follower_id, "model": model, "kv_world_size": 1,
                 "kv_worker_id": 0, "tp_rank": 1, "stores": 0, "retrieves": 0, "loads_pushed": 2},
                {"instance_id": other_id, "model": "other-model", "kv_world_size": 1,
                 "kv_worker_id": 0, "tp_rank": 1, "stores": 0, "retrieves": 0, "loads_pushed": 0}]
            assert list(stats["instances"][0]) == [
                row[0].removeprefix("instances[].") for row in
                table_after(doc_operations()["STATS"], "**Reply**")
                if row[0].startswith("instances[].")]
            for sock, instance_id in ((leader, leader_id), (follower, follower_id),
                                      (other, other_id)):
                assert call(sock, 6, "UNREGISTER_KV_CACHE", {"instance_id": instance_id}) == {}
    finally:
        for kv in caches.values():
            kv.close()


# ---------------------------------------------------------------------------
# The example client.

def test_example_client_runs_against_a_real_server(server: RunningServer, tmp_path: Path) -> None:
    (code, *_) = fenced_blocks(section("## Example client (Python)"), "python")
    assert "lmcache_mp" not in code
    assert 25 <= len(code.splitlines()) <= 60
    script = tmp_path / "client.py"
    script.write_text(code)

    # Store the first two chunks of the client's prompt (tokens 0..599) with the real client
    # library, so that the document's hash code must agree with lmcache_mp's to hit them.
    kv = SharedKVCache("mha", num_layers=2, num_blocks=8, block_size=128, heads=1, head_dim=8)
    try:
        with CacheClient(server.url) as client:
            registration = client.register_kv_cache(kv.handles(), model="example-model",
                                                    layout="mha", block_size=128)
            hashes = chunk_hashes(list(range(600)), 256)
            assert client.store(registration, [TransferItem.build("setup", hashes, [0, 1, 2, 3])]) \
                == [bytes([protocol.StoreStatus.STORED] * 2)]
            client.unregister(registration)
    finally:
        kv.close()

    result = subprocess.run([sys.executable, str(script), server.url], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"server \S+, protocol 1, chunk_size 256", lines[0]), lines
    assert lines[1:] == ["hits 2 of 2 chunks"]


# ---------------------------------------------------------------------------
# Malformed frames.

def test_malformed_frames_get_error_replies_and_the_server_keeps_serving(server: RunningServer) -> None:
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
        ([rid(15), b"HELLO", msgpack.packb({"protocol_version": 2})], rid(15), "unsupported_version"),
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
            {"request_id": "r" * 513, "chunk_hashes": b"", "hold": True}]})], rid(20), "bad_request"),
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
    with dealer(server.url) as sock:
        for frames, reply_id, code in cases:
            got_id, status, payload = exchange(sock, frames)
            assert (got_id, status, payload["code"]) == (reply_id, b"err", code), (frames, payload)
            assert isinstance(payload["message"], str) and payload["message"]
        # Unknown fields are ignored, optional ones take their defaults, and it still serves.
        _, status, hello = exchange(sock, [rid(21), b"HELLO", msgpack.packb(
            {"protocol_version": 1, "from_the_future": {"x": [1, 2]}})])
        assert status == b"ok" and hello["protocol_version"] == 1
        _, status, ping = exchange(sock, [rid(22), b"PING", msgpack.packb({})])
        assert status == b"ok" and isinstance(ping["server_time"], float)
        _, status, clear = exchange(sock, [rid(23), b"CLEAR", msgpack.packb({"cache_salt": "nobody"})])
        assert (status, clear) == (b"ok", {"removed": 0})
        # The longest request_id and a kv_world_size of 1024 are fine.
        _, status, lookup = exchange(sock, [rid(31), b"LOOKUP", msgpack.packb({
            "model": "m", "kv_world_size": MAX_KV_WORLD_SIZE,
            "items": [{"request_id": "r" * MAX_REQUEST_ID_CHARS, "chunk_hashes": b"", "hold": True}]})])
        assert (status, lookup) == (b"ok", {"hits": [0]})


# ---------------------------------------------------------------------------
# Limits and registrations.

def test_documented_limits_match_the_code() -> None:
    rows = {row[0]: row[1] for row in _limits_table()}
    assert rows["request_id fields"].startswith(f"at most {MAX_REQUEST_ID_CHARS} characters")
    assert rows["kv_world_size"].startswith(f"1 to {MAX_KV_WORLD_SIZE} ")
    assert rows["layers"] == f"1 to {MAX_LAYERS} handles"
    assert rows["quota cap"].startswith("≥ 0 bytes, or nil")
    assert rows["quota reserve"].startswith("0 to cap bytes; all salts' reservations together "
                                            "at most the pool size")
    register = doc_operations()["REGISTER_KV_CACHE"]
    (ws_row,) = [row for row in table_after(register, "**Request**") if row[0] == "kv_world_size"]
    assert f"1 to {MAX_KV_WORLD_SIZE}" in ws_row[3]
    (ws_row,) = [row for row in table_after(doc_operations()["LOOKUP"], "**Request**")
                 if row[0] == "kv_world_size"]
    assert f"1 to {MAX_KV_WORLD_SIZE}" in ws_row[3]
    # Nothing may say that ids are counted, or that an old id can name someone else's cache.
    assert "from 1 again" not in DOC and "another* worker" not in DOC


def _limits_table() -> list[list[str]]:
    lines = section("## Limits")
    start = next(i for i, line in enumerate(lines) if line.startswith("| limit"))
    rows = [[cell.strip().replace("`", "") for cell in line.strip().strip("|").split("|")]
            for line in lines[start:] if line.startswith("|")]
    return rows[2:]


def _unknown_instance_message(instance_id: int) -> str:
    """The unknown_instance message as the document quotes it, for this id."""
    (quoted,) = re.findall(r'"(no KV cache with instance_id N is registered by this\s+'
                           r'connection; register it \(again\) first)"',
                           "\n".join(section("## Sessions and heartbeats")))
    return re.sub(r"\s+", " ", quoted).replace(" N ", f" {instance_id} ")


def _fixed_identity_dealer(context: zmq.Context, url: str, identity: bytes) -> zmq.Socket:
    """A DEALER with `identity` that the server answers (it ignores an identity still connected)."""
    for attempt in range(20):
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.connect(url)
        sock.send_multipart([rid(1000 + attempt), b"PING", msgpack.packb({})])
        if sock.poll(500):
            assert sock.recv_multipart()[1] == b"ok"
            return sock
        sock.close()
    raise AssertionError(f"the server never answered identity {identity!r}")


def test_registrations_belong_to_the_routing_identity(server: RunningServer) -> None:
    kv = SharedKVCache("mha", num_layers=1, num_blocks=8, block_size=128, heads=1, head_dim=8)
    identity = b"lmcache-mp-" + uuid.uuid4().bytes
    context = zmq.Context()
    owner = other = None
    try:
        handles = [dataclasses.asdict(h) for h in kv.handles()]
        register = {"model": "owned-model", "kv_world_size": 1, "kv_worker_id": 0,
                    "layout": "mha", "block_size": 128, "layers": handles}
        owner = _fixed_identity_dealer(context, server.url, identity)
        for bad_size in (0, MAX_KV_WORLD_SIZE + 1):
            _, status, err = exchange(owner, [rid(1), b"REGISTER_KV_CACHE", msgpack.packb(
                dict(register, kv_world_size=bad_size))])
            assert (status, err["code"]) == (b"err", "bad_request"), err
        _, status, reg = exchange(owner, [rid(2), b"REGISTER_KV_CACHE", msgpack.packb(register)])
        assert status == b"ok", reg
        instance_id = reg["instance_id"]
        assert type(instance_id) is int and 1 <= instance_id < 2**53
        hashes = chunk_hashes(list(range(2000, 2256)), 256)
        item = {"request_id": "owned", "chunk_hashes": hashes[0],
                "block_ids": struct.pack("<2i", 0, 1)}

        # Another connection cannot use it: the same answer as for an id that names nothing.
        other = _fixed_identity_dealer(context, server.url, b"lmcache-mp-" + uuid.uuid4().bytes)
        for n, (op, payload) in enumerate([
                (b"STORE", {"instance_id": instance_id, "items": [item]}),
                (b"RETRIEVE", {"instance_id": instance_id, "items": [item]}),
                (b"UNREGISTER_KV_CACHE", {"instance_id": instance_id})]):
            _, status, err = exchange(other, [rid(10 + n), op, msgpack.packb(payload)])
            assert (status, err) == (b"err", {"code": "unknown_instance",
                                              "message": _unknown_instance_message(instance_id)})

        # While the owner is connected, a second socket with its identity is ignored.
        duplicate = context.socket(zmq.DEALER)
        duplicate.setsockopt(zmq.LINGER, 0)
        duplicate.setsockopt(zmq.ROUTING_ID, identity)
        duplicate.connect(server.url)
        duplicate.send_multipart([rid(15), b"PING", msgpack.packb({})])
        assert not duplicate.poll(300), "the server answered a duplicate identity"
        duplicate.close()

        # The owner reconnects with the same identity: the registration is still its own.
        owner.close()
        owner = _fixed_identity_dealer(context, server.url, identity)
        _, status, reply = exchange(owner, [rid(20), b"STORE", msgpack.packb(
            {"instance_id": instance_id, "items": [item]})])
        assert (status, reply) == (b"ok", {"results": [bytes([protocol.StoreStatus.STORED])]})
        assert exchange(owner, [rid(21), b"UNREGISTER_KV_CACHE", msgpack.packb(
            {"instance_id": instance_id})])[1:] == (b"ok", {})
        _, status, err = exchange(owner, [rid(22), b"UNREGISTER_KV_CACHE", msgpack.packb(
            {"instance_id": instance_id})])
        assert (status, err["code"]) == (b"err", "unknown_instance")
    finally:
        for sock in (owner, other):
            if sock is not None:
                sock.close()
        context.term()
        kv.close()
