"""docs/protocol.md, checked against the code and a real server.

- the op, field, error-code, status-byte and dtype tables match lmcache_mp.protocol
  (nested fields too: `items[].x` for arrays of maps, `tenants{}.x` for maps of maps),
  and so do the push-message frames and the LOAD_DONE fields; the admin ops are the
  ones the document marks as such;
- the Limits table is protocol.LIMITS, row by row (name, value and what it bounds), and
  the other documented limits and validation rules hold;
- the worked chunk-hash example matches lmcache_mp.client.chunk_hashes;
- the example exchange, replayed frame by frame against a fresh server on the
  connections it names (the worker's, the administrator's with the admin token, and a
  stranger's without HELLO), gets exactly the replies the document shows (and the KV
  bytes really move), with the placeholders bound to what the server and the fd channel
  returned; so do the quota exchange, the error examples (`bad_request`, `forbidden`,
  `unauthenticated`) and the QUOTA_SET error examples;
- sessions behave as documented: `unauthenticated` before HELLO and for a wrong token,
  `forbidden` for every admin op from an engine, HELLO replaces a session, STATS shows
  an engine no tenants and only its own engine's registrations, leases belong to an
  engine, refused requests are counted, integral floats are ints, the decoding bounds
  and LOOKUP's probe limit answer `bad_request`, a sliced LOOKUP answers as one, and a
  client that reads late still gets every reply;
- the fd channel takes sealed memfds and refuses everything else as documented, and
  its tickets are single-use;
- the quota model holds on a real server: the layers (default, --quota, --quota-file,
  QUOTA_SET), SIGHUP reloads, usage in 4096-byte units, OVER_QUOTA and STATS `tenants`;
- the MLA example exchange (a leader and a follower of one engine on two connections,
  with the follower's LOAD_DONE push) replays against a real server, and the MLA rules
  hold with a W3-like cache: only the leader stores and retrieves (the follower gets the
  documented bad_request), its RETRIEVE lands byte for byte in its own engine's
  followers and in no other cache (not in another engine's look-alike), the follower is
  told with one LOAD_DONE per RETRIEVE, and STATS `instances` counts it all;
- a registration can only be used by the routing identity that made it (also after
  that identity reconnects, when its session is still there);
- the example client, extracted from the document, runs against a real server on its
  default endpoint, on an explicit ipc:// URL and on tcp:// with the token, and finds
  the chunks that lmcache_mp's own client stored; tcp:// refuses a HELLO without token;
- malformed frames get the error replies the document promises and the server keeps
  serving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
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

from lmcache_mp import errors, protocol, runtime
from lmcache_mp.client import CacheClient, SharedKVCache, TransferItem, chunk_hashes
from lmcache_mp.client.hashing import HASH_SEED
from lmcache_mp.fdpass import BOUND_FD_CHANNEL_MAGIC, FD_CHANNEL_MAGIC, send_fds
from lmcache_mp.protocol import LIMITS, MAX_KV_WORLD_SIZE, MAX_LAYERS, MAX_REQUEST_ID_CHARS
from lmcache_mp.server.config import Config
from lmcache_mp.server.pool import ALIGNMENT, aligned
from lmcache_mp.server.registry import DTYPES
from lmcache_mp.spawn import ServerProcess

from .utils import run_server
from .workers import MLA, chunk_blocks, expected_blocks, make_cache, prompt

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"
DOC = DOC_PATH.read_text(encoding="utf-8")
DOC_LINES = DOC.splitlines()

REPLY_TIMEOUT_MS = 10_000
HELLO_ID = 999  # the request id the helpers' HELLO uses, apart from the tests' own ids


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
# A real server, and raw connections to it.

SERVER_CPU_SIZE = "64MiB"  # the pool of every server these tests start


@contextlib.contextmanager
def running_server(*args: str, url: str | None = None) -> Iterator[ServerProcess]:
    """`python -m lmcache_mp.server` with its own runtime directory (its default ipc://
    endpoint unless `url`); SIGTERM at the end must exit 0."""
    with run_server("--cpu-size", SERVER_CPU_SIZE, *args, url=url) as server:
        yield server


def fd_socket(server: ServerProcess) -> str:
    return str(server.runtime_dir / runtime.FD_SOCKET_NAME)


@contextlib.contextmanager
def dealer(url: str, identity: bytes | None = None) -> Iterator[zmq.Socket]:
    """A raw DEALER that has said nothing yet (no session)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
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


def refused(sock: zmq.Socket, n: int, op: str, payload: Any, raw: bool = False) -> dict:
    """Send one request that must be refused; return its error map."""
    got_id, status, reply = exchange(
        sock, [rid(n), op.encode(), payload if raw else msgpack.packb(payload)])
    assert (got_id, status) == (rid(n), b"err"), (op, reply)
    assert set(reply) == {"code", "message"} and reply["message"], reply
    return reply


def hello(sock: zmq.Socket, token: str = "", engine: str = "", n: int = HELLO_ID,
          client_name: str = "") -> dict:
    """Open the connection's session; returns HELLO's reply."""
    return call(sock, n, "HELLO", {"protocol_version": protocol.PROTOCOL_VERSION,
                                   "client_name": client_name, "token": token, "engine": engine})


@contextlib.contextmanager
def session(server: ServerProcess, admin: bool = False, engine: str = "",
            identity: bytes | None = None) -> Iterator[zmq.Socket]:
    """A raw DEALER that said HELLO: an engine session, or an admin one."""
    with dealer(server.url, identity) as sock:
        reply = hello(sock, server.token(admin=True) if admin else "", engine)
        assert reply["role"] == ("admin" if admin else "engine")
        yield sock


def ticket_for(path: str, kv: SharedKVCache, binding: bytes = b"") -> bytes:
    (ticket,) = send_fds(path, [kv.segment.fd], timeout=5, binding=binding)
    return ticket


def wire_handles(kv: SharedKVCache, path: str) -> list[dict[str, Any]]:
    """kv's layer handles, as a map each, with a fresh ticket for its segment."""
    ticket = ticket_for(path, kv)
    return [dict(dataclasses.asdict(h), ticket=ticket) for h in kv.handles()]


def replay(sock: zmq.Socket, messages: list[tuple[str, bytes, str, Any]]) -> None:
    """Send each `C:` message and check that the reply is exactly the `S:` message after it."""
    assert [m[0] for m in messages] == ["C", "S"] * (len(messages) // 2)
    for (_, request_id, op, request), (_, reply_id, status, expected) in zip(
            messages[0::2], messages[1::2]):
        assert reply_id == request_id
        got_id, got_status, got = exchange(
            sock, [request_id, op.encode(), msgpack.packb(request, use_bin_type=True)])
        assert (got_id, got_status.decode(), got) == (request_id, status, expected), op


def check_reply(op: str, got: Any, expected: Any, bound: dict[str, Any]) -> None:
    """`got` is `expected` once its placeholders are bound; HELLO's server_version is the
    server's own (any str)."""
    if op == "HELLO" and isinstance(got, dict) and "server_version" in got:
        got = dict(got)
        assert isinstance(got.pop("server_version"), str)
        expected = {k: v for k, v in expected.items() if k != "server_version"}
    assert got == bind(expected, got, bound), op


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
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
    # The unsupported-kind message the document quotes is the decoder's.
    flat = re.sub(r"\s+", " ", "\n".join(lines))
    (quoted,) = re.findall(r"`` (`layers\[0\]\.kind`: unsupported handle kind 'shm'; [^`]*) ``",
                           flat)
    raw = {"model": "m", "kv_world_size": 1, "kv_worker_id": 0, "layout": "mha",
           "block_size": 16, "layers": [{"kind": "shm"}]}
    with pytest.raises(errors.BadRequest) as refusal:
        protocol.unpack(protocol.RegisterKVCacheRequest, msgpack.packb(raw))
    assert str(refusal.value) == quoted


def test_error_codes_status_bytes_and_dtypes_match_the_code() -> None:
    error_rows = table_after(section("## Errors"), "An `err` reply", skip_prose=True)
    codes = [row[0] for row in error_rows]
    assert sorted(codes) == sorted(errors.ERROR_CLASSES)
    assert {"unauthenticated", "forbidden"} <= set(codes)
    assert protocol.ErrorReply.__annotations__ == {"code": "str", "message": "str"}
    # The forbidden row names every admin op, and only those are marked "Admin op".
    (forbidden_row,) = [row for row in error_rows if row[0] == "forbidden"]
    assert set(re.findall(r"\[([A-Z_]+)\]", forbidden_row[1])) == protocol.ADMIN_OPS
    marked = {op for op, lines in doc_operations().items()
              if next(line for line in lines if line.strip()).startswith("Admin op")}
    assert marked == protocol.ADMIN_OPS

    statuses = {int(row[0]): row[1] for row in table_after(doc_operations()["STORE"], "Status bytes")}
    expected = {value: name for name, value in vars(protocol.StoreStatus).items()
                if not name.startswith("_")}
    assert statuses == expected
    assert expected[4] == "OVER_QUOTA"
    # Quotas exist now: nothing may say otherwise.
    assert not re.search(r"no per-salt\s+quotas?", DOC) and "no quotas" not in DOC

    (dtype_line,) = [line for line in DOC_LINES if line.startswith("Accepted `dtype` names:")]
    assert re.findall(r"`([a-z0-9_]+)`", dtype_line.split(":", 1)[1]) == list(DTYPES)

    assert DOC_LINES[0] == f"# The lmcache-mp wire protocol, version {protocol.PROTOCOL_VERSION}"
    assert protocol.PROTOCOL_VERSION == 2
    # Version 1's shared-memory handles are gone: only the evolution notes name them.
    flat = re.sub(r"\s+", " ", DOC)
    assert "/dev/shm/<name>" not in flat and '"kind": "shm"' not in flat
    assert "tcp://127.0.0.1:5555" not in section("## Transport")


def _limit_rows() -> list[list[str]]:
    return table_after(section("## Limits"), "The server checks every limit", skip_prose=True)


def _limits_markdown() -> str:
    """The Limits table as it should read (values from the code; the last column is prose)."""
    return "\n".join(f"| `{name}` | {limit.value} | {limit.what} | … |"
                     for name, limit in LIMITS.items())


def test_the_limits_table_is_protocol_LIMITS_row_by_row() -> None:
    rows = _limit_rows()
    documented = [(row[0], int(row[1]), re.sub(r"\s+", " ", row[2])) for row in rows]
    expected = [(name, limit.value, limit.what) for name, limit in LIMITS.items()]
    assert documented == expected, "docs/protocol.md's Limits table must read:\n" + _limits_markdown()
    assert all(row[3] for row in rows), "every limit says what happens when it is exceeded"
    # The numbers quoted elsewhere are the same ones.
    encoding = re.sub(r"\s+", " ", " ".join(section("## Encoding")))
    for name in ("MAX_ITEMS_PER_MESSAGE", "MAX_MAP_FIELDS", "MAX_STRING_BYTES"):
        assert f"`{name}` ({LIMITS[name].value})" in encoding, name
    channel = re.sub(r"\s+", " ", " ".join(section("## The fd channel")))
    for name in ("MAX_FDS_PER_MESSAGE", "TICKET_TTL_S", "MAX_PENDING_TICKETS",
                 "MAX_PENDING_TICKETS_PER_UID", "MAX_WATCHES_PER_UID"):
        assert f"`{name}` ({LIMITS[name].value}" in channel, name
    lookup = re.sub(r"\s+", " ", " ".join(doc_operations()["LOOKUP"]))
    for name in ("MAX_LOOKUP_PROBES", "LOOKUP_SLICE_PROBES"):
        assert f"`{name}` ({LIMITS[name].value})" in lookup, name
    for op in ("STORE", "RETRIEVE"):
        text = re.sub(r"\s+", " ", " ".join(doc_operations()[op]))
        value = LIMITS["TRANSFER_SLICE_CHUNKS"].value
        assert f"`TRANSFER_SLICE_CHUNKS` ({value})" in text, op
    hello_rows = {row[0]: row[2] for row in table_after(doc_operations()["HELLO"], "**Reply**")}
    assert f"({protocol.MAX_ITEMS_PER_MESSAGE})" in hello_rows["max_items_per_message"]
    assert f"(default {protocol.MAX_CHUNKS_PER_MESSAGE})" in hello_rows["max_chunks_per_message"]


def test_documented_limits_match_the_code() -> None:
    rows = {row[0]: row[1] for row in table_after(section("## Limits"), "Other rules on values:")}
    assert rows["request_id fields"].startswith(f"at most {MAX_REQUEST_ID_CHARS} characters")
    assert rows["cache_salt"].startswith(f"0 to {protocol.MAX_SALT_CHARS} characters")
    assert rows["model"].startswith(f"1 to {protocol.MAX_MODEL_CHARS} characters")
    assert rows["client_name, token, engine, tp_group, handle name"] == \
        f"at most {protocol.MAX_NAME_CHARS} characters"
    assert rows["kv_world_size"].startswith(f"1 to {MAX_KV_WORLD_SIZE} ")
    assert rows["tp_rank"] == f"0 to {MAX_KV_WORLD_SIZE - 1}"
    assert rows["layers"] == f"1 to {MAX_LAYERS} handles"
    assert rows["ticket (memfd)"].startswith(f"{protocol.TICKET_BYTES} bytes")
    assert f"under {protocol.TICKET_TTL_S} s old" in rows["ticket (memfd)"]
    assert rows["quota cap"].startswith("≥ 0 bytes, or nil")
    assert rows["quota reserve"].startswith("0 to cap bytes; all salts' reservations together "
                                            "at most the pool size")
    register = doc_operations()["REGISTER_KV_CACHE"]
    (ws_row,) = [row for row in table_after(register, "**Request**") if row[0] == "kv_world_size"]
    assert f"1 to {MAX_KV_WORLD_SIZE}" in ws_row[3]
    (tp_row,) = [row for row in table_after(register, "**Request**") if row[0] == "tp_rank"]
    assert f"0 to {MAX_KV_WORLD_SIZE - 1}" in tp_row[3]
    (ws_row,) = [row for row in table_after(doc_operations()["LOOKUP"], "**Request**")
                 if row[0] == "kv_world_size"]
    assert f"1 to {MAX_KV_WORLD_SIZE}" in ws_row[3]
    # Nothing may say that ids are counted, or that an old id can name someone else's cache.
    assert "from 1 again" not in DOC.replace("request ids count from 1 again", "")
    assert "another* worker" not in DOC


# ---------------------------------------------------------------------------
# Links.

def _anchors(text: str) -> set[str]:
    """GitHub's anchors for a markdown file's headings."""
    anchors, in_fence = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            title = line.lstrip("#").strip().replace("`", "").lower()
            anchors.add(re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return anchors


def test_links_between_the_documents_resolve() -> None:
    security = (DOC_PATH.parent / "security.md").read_text(encoding="utf-8")
    own = _anchors(DOC)
    for name, text in (("protocol.md", DOC), ("security.md", security)):
        for target, fragment in re.findall(r"\]\(([a-z./]*)#([a-z0-9_-]+)\)", text):
            anchors = own if target == "protocol.md" or (not target and name == "protocol.md") \
                else _anchors(security)
            assert fragment in anchors, f"{name}: ({target}#{fragment}) names no heading"
        for target in re.findall(r"\]\(([a-z]+\.md)\)", text):
            assert (DOC_PATH.parent / target).exists(), f"{name}: {target}"
    # The security model names every threat the protocol's mechanisms answer.
    for words in ("F_SEAL_SHRINK", "cache_salt", "REPLY_BACKLOG_BYTES", "--socket-group",
                  "--token-file", "tests/security/"):
        assert words in security, words


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
            good = {"request_id": "a", "chunk_hashes": hashes[0], "block_ids": struct.pack("<2i", 0, 1)}
            bad = {"request_id": "b", "chunk_hashes": hashes[1], "block_ids": struct.pack("<2i", 2, 99)}
            err = refused(sock, 2, "STORE", {"instance_id": reg["instance_id"], "items": [good, bad]})
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
# Sessions, roles and engines.

def _quoted(heading: str, pattern: str) -> str:
    """The one message matching `pattern` that the section quotes, whitespace collapsed."""
    (quoted,) = re.findall(pattern, re.sub(r"\s+", " ", "\n".join(section(heading))))
    return quoted


def test_sessions_roles_and_engines_work_as_documented(server: ServerProcess) -> None:
    no_session = _quoted("## Sessions and heartbeats", r'"(this connection has no session:[^"]*)"')
    forbidden = _quoted("## Sessions and heartbeats", r'"(QUOTA_LIST is an admin op:[^"]*)"')
    S = protocol.StoreStatus
    kv = SharedKVCache("mha", num_layers=1, num_blocks=8, block_size=128, heads=1, head_dim=8)
    hashes = chunk_hashes(list(range(5000, 5512)), 256)
    admin_ops = {"CLEAR": {}, "QUOTA_SET": {"cache_salt": "x", "cap": None},
                 "QUOTA_GET": {"cache_salt": "x"}, "QUOTA_DELETE": {"cache_salt": "x"},
                 "QUOTA_LIST": {}}
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
                payload = {"model": "m", "kv_world_size": 1, "items": []} if op == "LOOKUP" \
                    else {"request_id": "r"} if op == "END_SESSION" else {}
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
                assert call(sock, 45, "END_SESSION", {"request_id": "req", "cache_salt": "team-x"}) \
                    == {"released": 0}
                assert call(sock, 46, "RELEASE", {"items": [
                    {"request_id": "req", "cache_salt": "team-x"}]}) == {"released": 0}
            assert call(admin, 47, "STATS", {})["leases_held"] >= 1
            assert call(worker_a, 48, "END_SESSION", {"request_id": "req", "cache_salt": "team-x"}) \
                == {"released": 2}

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
            assert call(worker_a, 53, "UNREGISTER_KV_CACHE", {"instance_id": reg["instance_id"]}) == {}
    finally:
        kv.close()


def test_decoding_bounds_and_the_lookup_probe_limit(server: ServerProcess) -> None:
    encoding = re.sub(r"\s+", " ", " ".join(section("## Encoding")))
    (quoted,) = re.findall(r'\("(payload holds an array of 1025 elements, more than '
                           r'MAX_ITEMS_PER_MESSAGE allows \(1024: [^"]*\))"\)', encoding)
    probes = _quoted("### `LOOKUP`", r'\("(`items`: 307200 index probes[^"]*)"\)')
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
            "model": "m" * (protocol.MAX_STRING_BYTES + 1), "kv_world_size": 1, "items": []})["message"]
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
    with session(server) as sock:
        for n in range(1, count + 1):
            sock.send_multipart([rid(n), b"STATS", msgpack.packb({})])
        time.sleep(1.0)  # the server answers everything while nobody reads
        got = set()
        while len(got) < count:
            assert sock.poll(REPLY_TIMEOUT_MS), f"{len(got)} of {count} replies arrived"
            reply_id, status, _ = sock.recv_multipart()
            assert status == b"ok"
            got.add(struct.unpack("<Q", reply_id)[0])
        assert got == set(range(1, count + 1))
        assert call(sock, count + 1, "PING", {})


# ---------------------------------------------------------------------------
# The fd channel.

def _fd_channel_request(path: str, fds: list[int], data: bytes = FD_CHANNEL_MAGIC) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(5)
        sock.connect(path)
        socket.send_fds(sock, [data], fds)
        reply = sock.recv(4096)
        assert sock.recv(4096) == b"", "one exchange per connection"
    return msgpack.unpackb(reply, raw=False)


def _memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("doc-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_the_fd_channel_works_as_documented(server: ServerProcess, tmp_path: Path) -> None:
    channel = re.sub(r"\s+", " ", " ".join(section("## The fd channel")))
    assert f"exactly the 16 ASCII bytes `{FD_CHANNEL_MAGIC.decode()}`" in channel
    assert len(FD_CHANNEL_MAGIC) == 16 and "`AF_UNIX`, `SOCK_SEQPACKET`" in channel
    assert (f"the 16 ASCII bytes `{BOUND_FD_CHANNEL_MAGIC.decode()}` followed by the "
            f"session's {protocol.BINDING_BYTES}-byte `fd_binding`") in channel
    assert len(BOUND_FD_CHANNEL_MAGIC) == 16
    assert f"each is {protocol.TICKET_BYTES} random bytes" in channel
    path = fd_socket(server)
    with session(server) as sock:
        reply = call(sock, 1, "HELLO", {"protocol_version": 2})
        assert reply["fd_socket"] == path and len(reply["fd_binding"]) == protocol.BINDING_BYTES
    assert os.stat(path).st_mode & 0o777 == 0o600

    good = _memfd(4096, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    shrink_only = _memfd(4096, fcntl.F_SEAL_SHRINK)
    unsealed = _memfd(4096, 0)
    write_sealed = _memfd(4096, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
    empty = _memfd(0, fcntl.F_SEAL_SHRINK)
    read_only = os.open(f"/proc/self/fd/{good}", os.O_RDONLY)
    regular = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(regular, 4096)
    pipe_r, pipe_w = os.pipe()
    opened = [good, shrink_only, unsealed, write_sealed, empty, read_only, regular, pipe_r, pipe_w]
    try:
        answer = _fd_channel_request(path, [good, shrink_only])
        assert list(answer) == ["tickets"] and len(answer["tickets"]) == 2
        assert all(type(t) is bytes and len(t) == protocol.TICKET_BYTES for t in answer["tickets"])
        for fds, data, why in [
                ([unsealed], FD_CHANNEL_MAGIC, "F_SEAL_SHRINK"),
                ([regular], FD_CHANNEL_MAGIC, "F_SEAL_SHRINK"),
                ([pipe_r], FD_CHANNEL_MAGIC, "pipe"),
                ([write_sealed], FD_CHANNEL_MAGIC, "F_SEAL_WRITE"),
                ([read_only], FD_CHANNEL_MAGIC, "reading and writing"),
                ([empty], FD_CHANNEL_MAGIC, "empty"),
                ([good, unsealed], FD_CHANNEL_MAGIC, "fd 1"),
                ([good], b"lmcache-mp-fds/0", "not an fd channel request"),
                ([good] * (protocol.MAX_FDS_PER_MESSAGE + 1), FD_CHANNEL_MAGIC, "did not all arrive"),
                ([], FD_CHANNEL_MAGIC, "no descriptors")]:
            answer = _fd_channel_request(path, fds, data)
            assert list(answer) == ["error"] and why in answer["error"], (why, answer)

        # A bound ticket serves its engine: another engine's REGISTER is refused, and the
        # ticket stays valid for its own.
        assert "unknown fd_binding" in _fd_channel_request(
            path, [good], BOUND_FD_CHANNEL_MAGIC + bytes(protocol.BINDING_BYTES))["error"]
        assert "spends none of its tickets" in channel
        kv = SharedKVCache("mla", num_layers=2, num_blocks=8, block_size=128, heads=1, head_dim=8)
        try:
            with session(server, engine="fd-engine") as owner, \
                    session(server, engine="fd-other") as other:
                binding = hello(owner, engine="fd-engine", n=1)["fd_binding"]
                (bound,) = _fd_channel_request(path, [kv.segment.fd],
                                               BOUND_FD_CHANNEL_MAGIC + binding)["tickets"]
                register = {"model": "fd-model", "kv_world_size": 1, "kv_worker_id": 0,
                            "layout": "mla", "block_size": 128, "layers": [
                                dict(dataclasses.asdict(h), ticket=bound) for h in kv.handles()]}
                err = refused(other, 2, "REGISTER_KV_CACHE", register)
                assert err["code"] == "bad_request" and "another engine" in err["message"]
                reg = call(owner, 2, "REGISTER_KV_CACHE", register)
                assert call(owner, 3, "UNREGISTER_KV_CACHE",
                            {"instance_id": reg["instance_id"]}) == {}
            register = {"model": "fd-model", "kv_world_size": 1, "kv_worker_id": 0,
                        "layout": "mla", "block_size": 128,
                        "layers": wire_handles(kv, path)}  # both layers: one ticket
            assert len({h["ticket"] for h in register["layers"]}) == 1
            with session(server) as sock:
                reg = call(sock, 2, "REGISTER_KV_CACHE", register)
                err = refused(sock, 3, "REGISTER_KV_CACHE", register)
                assert err["code"] == "bad_request"
                assert err["message"].startswith("`layers[0].ticket`: unknown or expired ticket")
                short = dict(register, layers=[dict(h, ticket=b"x" * 17) for h in register["layers"]])
                assert "expected 16 bytes" in refused(sock, 4, "REGISTER_KV_CACHE", short)["message"]
                named = dict(register, layers=[dict(h, ticket=ticket_for(path, kv), name="n" * 257)
                                               for h in register["layers"]])
                assert refused(sock, 5, "REGISTER_KV_CACHE", named)["message"] == \
                    f"`layers[0].name`: at most {protocol.MAX_NAME_CHARS} characters"
                assert call(sock, 6, "UNREGISTER_KV_CACHE", {"instance_id": reg["instance_id"]}) == {}
        finally:
            kv.close()
    finally:
        for fd in opened:
            os.close(fd)


# ---------------------------------------------------------------------------
# Quotas.

def test_quota_set_error_examples_replay_against_a_real_server() -> None:
    lines = doc_operations()["QUOTA_SET"]
    (block,) = fenced_blocks(lines, "text")
    messages = parse_exchange(block)
    assert {m[2] for m in messages[0::2]} == {"QUOTA_SET"}
    assert {(m[2], m[3]["code"]) for m in messages[1::2]} == {("err", "bad_request")}
    # The examples name the pool size they were made on: the one these servers have, and
    # the admin session they need.
    prose = re.sub(r"\s+", " ", " ".join(lines))
    assert f"started with `--cpu-size {SERVER_CPU_SIZE}`, from an admin session" in prose
    with running_server() as running, session(running, admin=True) as sock:
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
                session(running, admin=True) as sock:
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
                "block_size": 128, "layers": wire_handles(kv, fd_socket(running))})
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
            running.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while (info := call(sock, 14, "QUOTA_GET", {"cache_salt": "team-f"}))["cap"] != 16 * KiB:
                assert time.monotonic() < deadline, info
                time.sleep(0.05)
            assert info == _quota("team-f", 16 * KiB, 0, True, 2 * footprint)
            assert call(sock, 15, "QUOTA_GET", {"cache_salt": "team-r"}) == \
                _quota("team-r", MiB, 0, False, 0)  # gone from the file: the default again
            # A file that breaks the rules changes nothing.
            quota_file.write_text('[quotas]\n"team-f" = "1MiB:2MiB"\n')
            running.proc.send_signal(signal.SIGHUP)
            time.sleep(0.5)
            assert call(sock, 16, "QUOTA_GET", {"cache_salt": "team-f"})["cap"] == 16 * KiB
            # Without the file's entry, the flag's quota applies again.
            quota_file.write_text("[quotas]\n")
            running.proc.send_signal(signal.SIGHUP)
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

    # The LOAD_DONE and LOAD_PROGRESS tables are their messages, field for field, and
    # each message's `event` is its heading.
    for event, message in protocol.PUSH_MESSAGES.items():
        (lines,) = [lines for heading, lines in _subsections(_push_section()).items()
                    if heading == event]
        rows = table_after(lines, "**Fields**")
        assert [tuple(row[:2]) for row in rows] == [(path, tp) for path, tp, _ in
                                                    code_fields(message)]
        (event_row,) = [row for row in rows if row[0] == "event"]
        assert message.__dataclass_fields__["event"].default == event
        assert f'"{event}"' in event_row[2]

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


@contextlib.contextmanager
def _connections(url: str, *names: str) -> Iterator[dict[str, zmq.Socket]]:
    """One DEALER per name, each with a fixed routing identity, as a registering client has;
    none has said HELLO yet."""
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
        sent_ops: dict[tuple[str, bytes], str] = {}
        with running_server() as running, \
                _connections(running.url, "leader", "follower") as sockets:
            for connection, side, request_id, word, payload in messages:
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
                table_after(doc_operations()["STATS"], "**Reply**")
                if row[0].startswith("instances[].")]
            for name, instance_id in zip(names, (leader_id, follower_id, other_id, intruder_id)):
                assert call(sockets[name], 6, "UNREGISTER_KV_CACHE",
                            {"instance_id": instance_id}) == {}
    finally:
        for kv in caches.values():
            kv.close()


# ---------------------------------------------------------------------------
# The example client, and tcp:// endpoints.

def _example_client(tmp_path: Path) -> Path:
    (code, *_) = fenced_blocks(section("## Example client (Python)"), "python")
    assert "lmcache_mp" not in code
    assert 25 <= len(code.splitlines()) <= 65
    script = tmp_path / "client.py"
    script.write_text(code)
    return script


def _store_example_chunks(client: CacheClient) -> None:
    """Store the first two chunks of the example client's prompt (tokens 0..599) with the
    real client library, so that the document's hash code must agree with lmcache_mp's to
    hit them."""
    kv = SharedKVCache("mha", num_layers=2, num_blocks=8, block_size=128, heads=1, head_dim=8)
    try:
        registration = client.register_kv_cache(kv.handles(), model="example-model",
                                                layout="mha", block_size=128)
        hashes = chunk_hashes(list(range(600)), 256)
        assert client.store(registration, [TransferItem.build("setup", hashes, [0, 1, 2, 3])]) \
            == [bytes([protocol.StoreStatus.STORED] * 2)]
        client.unregister(registration)
    finally:
        kv.close()


def _run_example(script: Path, args: list[str], env: dict[str, str]) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_MP_")}
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                            text=True, timeout=60, env={**clean, **env})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert re.fullmatch(rf"server \S+, protocol {protocol.PROTOCOL_VERSION}, chunk_size 256",
                        lines[0]), lines
    return lines[1:]


def test_example_client_runs_against_a_real_server(server: ServerProcess, tmp_path: Path) -> None:
    script = _example_client(tmp_path)
    with server.client() as client:
        _store_example_chunks(client)
    # On the URL it is given, and with none: the default endpoint for the runtime directory.
    assert _run_example(script, [server.url], {}) == ["hits 2 of 2 chunks"]
    assert _run_example(script, [], {runtime.RUNTIME_DIR_ENV: str(server.runtime_dir)}) == \
        ["hits 2 of 2 chunks"]
    # Its default is lmcache_mp's: the same runtime directory rules, whatever the environment.
    code = script.read_text()
    namespace: dict[str, Any] = {}
    exec(code[:code.index("url = ")], namespace)  # the imports and default_url()
    for env in ({}, {"XDG_RUNTIME_DIR": str(tmp_path)}, {"XDG_RUNTIME_DIR": "/nonexistent"},
                {runtime.RUNTIME_DIR_ENV: "/somewhere"}):
        with _environment(env):
            assert namespace["default_url"]() == runtime.ipc_url(runtime.default_runtime_dir()), env


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    names = ("XDG_RUNTIME_DIR", runtime.RUNTIME_DIR_ENV)
    saved = {name: os.environ.get(name) for name in names}
    try:
        for name in names:
            os.environ.pop(name, None)
        os.environ.update(values)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_tcp_endpoints_need_the_token(tmp_path: Path) -> None:
    needs_token = _quoted("## Sessions and heartbeats", r'"(HELLO: this endpoint needs a token: )\.\.\."')
    url = f"tcp://127.0.0.1:{_free_port()}"
    script = _example_client(tmp_path)
    with running_server(url=url) as running:
        with dealer(url) as sock:
            err = refused(sock, 1, "HELLO", {"protocol_version": 2})
            assert err["code"] == "unauthenticated" and err["message"].startswith(needs_token)
            assert refused(sock, 2, "STATS", {})["code"] == "unauthenticated"
            assert hello(sock, running.token(), n=3)["role"] == "engine"
            assert hello(sock, running.token(admin=True), n=4)["role"] == "admin"
        with running.client() as client:
            _store_example_chunks(client)
        assert _run_example(script, [url], {runtime.TOKEN_ENV: running.token()}) == \
            ["hits 2 of 2 chunks"]
    # Beyond loopback only with an operator's token file.
    with pytest.raises(SystemExit):
        Config.from_args(["--host", "0.0.0.0", "--runtime-dir", str(tmp_path / "run")], env={})
    token_file = tmp_path / "token"
    token_file.write_text("0123456789abcdef0123\n")
    token_file.chmod(0o600)
    assert Config.from_args(["--host", "0.0.0.0", "--token-file", str(token_file)],
                            env={}).bind_url == "tcp://0.0.0.0:5555"


# ---------------------------------------------------------------------------
# Malformed frames.

def test_malformed_frames_get_error_replies_and_the_server_keeps_serving(server: ServerProcess) -> None:
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
        ([rid(15), b"HELLO", msgpack.packb({"protocol_version": 1})], rid(15), "unsupported_version"),
        ([rid(32), b"HELLO", msgpack.packb({"protocol_version": 3})], rid(32), "unsupported_version"),
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
            "items": [{"request_id": "r" * MAX_REQUEST_ID_CHARS, "chunk_hashes": b"", "hold": True}]})])
        assert (status, lookup) == (b"ok", {"hits": [0]})


# ---------------------------------------------------------------------------
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
                    "layout": "mha", "block_size": 128, "layers": wire_handles(kv, fd_socket(server))}
        owner = _fixed_identity_dealer(context, server.url, identity)
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
        other = _fixed_identity_dealer(context, server.url, b"lmcache-mp-" + uuid.uuid4().bytes)
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
        owner = _fixed_identity_dealer(context, server.url, identity)
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
