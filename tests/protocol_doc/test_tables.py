"""The tables of docs/protocol.md match the code: ops and their fields (nested ones too:
`items[].x` for arrays of maps, `tenants{}.x` for maps of maps), handle kinds, error codes,
status bytes and dtypes, and the Limits table is protocol.LIMITS row by row; the other
documented limits hold; links between the documents resolve; the worked chunk-hash example
matches lmcache_mp.client.chunk_hashes."""

from __future__ import annotations

import re
import typing

import msgpack
import pytest

from lmcache_mp import errors, protocol
from lmcache_mp.client import chunk_hashes
from lmcache_mp.client.hashing import HASH_SEED
from lmcache_mp.protocol import LIMITS, MAX_KV_WORLD_SIZE, MAX_LAYERS, MAX_REQUEST_ID_CHARS
from lmcache_mp.server.memory.geometry import DTYPES

from .document import (
    DOC,
    DOC_LINES,
    DOC_PATH,
    code_fields,
    doc_operations,
    fenced_blocks,
    section,
    table_after,
    table_at,
)

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
        rows = table_at(lines, f"**`{cls.KIND}` handle**", skip_prose=True)
        assert [tuple(row[:3]) for row in rows] == code_fields(cls), cls.KIND
    (layers_row,) = [row for row in table_at(doc_operations()["REGISTER_KV_CACHE"],
                                             "**Request**") if row[0] == "layers"]
    assert all(f"{cls.KIND} handle" in layers_row[3]
               for cls in typing.get_args(protocol.TensorHandle))
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
    error_rows = table_at(section("## Errors"), "An `err` reply", skip_prose=True)
    codes = [row[0] for row in error_rows]
    assert sorted(codes) == sorted(errors.ERROR_CLASSES)
    assert {"unauthenticated", "forbidden"} <= set(codes)
    assert typing.get_type_hints(protocol.ErrorReply) == {"code": str, "message": str}
    # The forbidden row names every admin op, and only those are marked "Admin op".
    (forbidden_row,) = [row for row in error_rows if row[0] == "forbidden"]
    assert set(re.findall(r"\[([A-Z_]+)\]", forbidden_row[1])) == protocol.ADMIN_OPS
    marked = {op for op, lines in doc_operations().items()
              if next(line for line in lines if line.strip()).startswith("Admin op")}
    assert marked == protocol.ADMIN_OPS

    statuses = {int(row[0]): row[1]
                for row in table_at(doc_operations()["STORE"], "Status bytes")}
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
    return table_at(section("## Limits"), "The server checks every limit", skip_prose=True)


def _limits_markdown() -> str:
    """The Limits table as it should read (values from the code; the last column is prose)."""
    return "\n".join(f"| `{name}` | {limit.value} | {limit.what} | … |"
                     for name, limit in LIMITS.items())


def test_the_limits_table_is_protocol_LIMITS_row_by_row() -> None:
    rows = _limit_rows()
    documented = [(row[0], int(row[1]), re.sub(r"\s+", " ", row[2])) for row in rows]
    expected = [(name, limit.value, limit.what) for name, limit in LIMITS.items()]
    assert documented == expected, \
        "docs/protocol.md's Limits table must read:\n" + _limits_markdown()
    assert all(row[3] for row in rows), "every limit says what happens when it is exceeded"
    # The numbers quoted elsewhere are the same ones.
    encoding = re.sub(r"\s+", " ", " ".join(section("## Encoding")))
    for name in ("MAX_ITEMS_PER_MESSAGE", "MAX_MAP_FIELDS", "MAX_STRING_BYTES"):
        assert f"`{name}` ({LIMITS[name].value})" in encoding, name
    channel = re.sub(r"\s+", " ", " ".join(section("## The fd channel")))
    for name in ("MAX_FDS_PER_MESSAGE", "TICKET_TTL_S", "MAX_PENDING_TICKETS",
                 "MAX_PENDING_TICKETS_PER_UID", "MAX_WATCHES_PER_UID", "FD_REQUEST_TIMEOUT_MS",
                 "MAX_WAITING_FD_CONNECTIONS", "MAX_WAITING_FD_CONNECTIONS_PER_UID"):
        assert f"`{name}` ({LIMITS[name].value}" in channel, name
    lookup = re.sub(r"\s+", " ", " ".join(doc_operations()["LOOKUP"]))
    for name in ("MAX_LOOKUP_PROBES", "LOOKUP_SLICE_PROBES"):
        assert f"`{name}` ({LIMITS[name].value})" in lookup, name
    for op in ("STORE", "RETRIEVE"):
        text = re.sub(r"\s+", " ", " ".join(doc_operations()[op]))
        value = LIMITS["TRANSFER_SLICE_CHUNKS"].value
        assert f"`TRANSFER_SLICE_CHUNKS` ({value})" in text, op
    hello_rows = {row[0]: row[2] for row in table_at(doc_operations()["HELLO"], "**Reply**")}
    assert f"({protocol.MAX_ITEMS_PER_MESSAGE})" in hello_rows["max_items_per_message"]
    assert f"(default {protocol.MAX_CHUNKS_PER_MESSAGE})" in hello_rows["max_chunks_per_message"]


def test_documented_limits_match_the_code() -> None:
    rows = {row[0]: row[1] for row in table_at(section("## Limits"), "Other rules on values:")}
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
    (ws_row,) = [row for row in table_at(register, "**Request**") if row[0] == "kv_world_size"]
    assert f"1 to {MAX_KV_WORLD_SIZE}" in ws_row[3]
    (tp_row,) = [row for row in table_at(register, "**Request**") if row[0] == "tp_rank"]
    assert f"0 to {MAX_KV_WORLD_SIZE - 1}" in tp_row[3]
    (ws_row,) = [row for row in table_at(doc_operations()["LOOKUP"], "**Request**")
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
    expected = [h.hex() for h in chunk_hashes(list(range(512)), 256)]
    assert [values["hash[0]"], values["hash[1]"]] == expected
    assert [values[f"hash[{i}]"] for i in range(3)] == \
        [h.hex() for h in chunk_hashes(list(range(768)), 256)]
