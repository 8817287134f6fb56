"""A request trace in Mooncake's JSONL format, read and checked: its requests and their
blocks as the server's chunk hashes.

One JSON object a line: `timestamp` (ms since the trace's start), `input_length` and
`output_length` (tokens), `hash_ids` (one id per block of the input, the trace's prefix
hashes: two requests sharing their first N ids share a prefix of N blocks). A block is
one chunk here; the last block of a prompt is usually partial, and is one chunk all the
same (the tokens it holds are counted as they are). Every field is checked: a trace is a
file from elsewhere.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 512  # Mooncake's block: the chunk size the replay's server uses
_HASH = struct.Struct(">8sQ")  # a 16-byte chunk hash (protocol.CHUNK_HASH_BYTES)
_HASH_TAG = b"mooncake"
MAX_HASH_ID = 2**64 - 1


class TraceError(ValueError):
    """A trace file that cannot be replayed: the message names the line and the field."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: int
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]

    def hit_tokens(self, hit_blocks: int) -> int:
        """Prompt tokens in the first `hit_blocks` blocks (the last one may be partial)."""
        return min(hit_blocks * BLOCK_TOKENS, self.input_tokens)


def chunk_hash(hash_id: int) -> bytes:
    """The chunk hash a trace's block id stands for: distinct ids, distinct hashes. The
    trace's ids are prefix hashes already, so a request's chunk i has its chunk i - 1 as
    parent, as the server's own hashes would."""
    return _HASH.pack(_HASH_TAG, hash_id)


def read_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The first `limit` requests of the trace (all without it), in timestamp order
    (a stable sort: ties keep the file's order); TraceError for a malformed line."""
    requests: list[TraceRequest] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(requests) == limit:
                break
            if line.strip():
                requests.append(_parse(line, f"{path}:{number}"))
    if not requests:
        raise TraceError(f"{path}: no requests")
    return sorted(requests, key=lambda request: request.timestamp_ms)


def _parse(line: str, where: str) -> TraceRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: not a JSON object")
    timestamp, input_tokens, output_tokens = (
        _count(record, name, where) for name in ("timestamp", "input_length", "output_length"))
    ids = record.get("hash_ids")
    if not isinstance(ids, list) or not ids:
        raise TraceError(f"{where}: `hash_ids` must be a non-empty list")
    if any(type(i) is not int or not 0 <= i <= MAX_HASH_ID for i in ids):
        raise TraceError(f"{where}: `hash_ids` must hold integers in [0, 2**64)")
    if len(set(ids)) != len(ids):
        raise TraceError(f"{where}: `hash_ids` repeats an id (prefix hashes cannot)")
    if -(-input_tokens // BLOCK_TOKENS) != len(ids):
        raise TraceError(f"{where}: {len(ids)} hash ids for {input_tokens} input tokens "
                         f"(one per {BLOCK_TOKENS}-token block expected)")
    return TraceRequest(timestamp, input_tokens, output_tokens, tuple(ids))


def _count(record: dict, name: str, where: str) -> int:
    value = record.get(name)
    if type(value) is not int or value < 0:
        raise TraceError(f"{where}: `{name}` must be a non-negative integer, got {value!r}")
    return value


def blocks(requests: list[TraceRequest]) -> Iterator[int]:
    """Every block access, request by request."""
    for request in requests:
        yield from request.hash_ids


def distinct_blocks(requests: list[TraceRequest]) -> int:
    """The trace's working set in blocks: what an unbounded cache ends with."""
    return len(set(blocks(requests)))
