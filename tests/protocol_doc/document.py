"""Reading docs/protocol.md: its sections, tables and fenced blocks; what the code says the tables
must hold; and the example-exchange notation."""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, Union

import msgspec

from lmcache_mp import protocol

DOC_PATH = Path(__file__).resolve().parent.parent.parent / "docs" / "protocol.md"
DOC = DOC_PATH.read_text(encoding="utf-8")
DOC_LINES = DOC.splitlines()


# ---------------------------------------------------------------------------
# Reading the document.

def section(heading: str) -> list[str]:
    """The lines after `heading` (an exact line) up to the next heading of the same or a
    higher level."""
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
    blocks: list[str] = []
    current: list[str] | None = None
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
    while i < len(lines) and (not lines[i].strip()
                              or (skip_prose and not lines[i].startswith("|"))):
        i += 1
    if i == len(lines) or not lines[i].startswith("|"):
        return None
    rows = []
    while i < len(lines) and lines[i].startswith("|"):
        cells = lines[i].strip().strip("|").split("|")
        rows.append([cell.strip().replace("`", "") for cell in cells])
        i += 1
    header, separator, *body = rows
    assert set("".join(separator)) <= set("- "), f"not a table separator: {separator}"
    return body


def table_at(lines: list[str], marker: str, skip_prose: bool = False) -> list[list[str]]:
    """table_after's rows where the document must have that table: its absence fails, naming
    the marker."""
    rows = table_after(lines, marker, skip_prose)
    assert rows is not None, f"no table right after {marker!r}"
    return rows


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
        if msgspec.UnsetType in typing.get_args(tp):  # a field left out when unset
            (inner,) = [arg for arg in typing.get_args(tp) if arg is not msgspec.UnsetType]
            return type_name(inner)
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
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif callable(f.default_factory):  # not MISSING
        value = f.default_factory()
    else:
        return "required"
    if isinstance(value, bytes):
        return f'hex"{value.hex()}"'
    if value is msgspec.UNSET:
        return "left out"
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


def quoted_message(heading: str, pattern: str) -> str:
    """The one message matching `pattern` that the section quotes, whitespace collapsed."""
    (quoted,) = re.findall(pattern, re.sub(r"\s+", " ", "\n".join(section(heading))))
    return quoted
