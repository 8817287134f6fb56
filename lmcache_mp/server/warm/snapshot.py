"""The warm-restart snapshot's format: an authenticated, columnar index of the pool's chunks.

A snapshot is a 48-byte header, then a msgpack map (the body):

    header: magic b"LMCS", format (u16), 0 (u16), body length (u64), HMAC-SHA256 (32 bytes)
            of the first 16 header bytes and the body, keyed by the server's snapshot key
    body:   capacity, chunk_size, count (N), scopes ([model, kv_world_size, kv_worker_id,
            cache_salt] each), geometries ([layout, num_layers, block shape, dtype,
            blocks_per_chunk] each), and one little-endian column of N values per field:
            scope (u32 index), geometry (u32 index), offset (u64), hash (16 bytes),
            parent (i64: the index of the chunk before it in its prompt, always earlier in
            the snapshot; -1 for a prompt's first), recency (u64: a lower value, used
            longer ago), checksum (u32: CRC-32 of the chunk's bytes in the pool)

Columns instead of an entry per chunk: a million chunks encode and decode in a few numpy
calls, not a million Python objects. The MAC is checked before the body is parsed, so no
byte that a server without the key wrote ever reaches the msgpack parser; the body is
then checked as if it were hostile anyway (bounds, overlaps, parents, duplicates), since
a snapshot is only as good as the server that wrote it.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np

from ...errors import ServerCondition
from ...protocol import CHUNK_HASH_BYTES
from ..cache.chunk import SavedIndex
from ..cache.pool import ALIGNMENT
from ..memory.geometry import DTYPES, LAYOUTS, Geometry

FORMAT = 3  # written by this server; 3: authenticated and columnar (2: a msgpack entry a chunk)
# Formats this server adopts. Not 2 nor 1: nothing authenticated them.
READABLE_FORMATS = frozenset({3})
MAGIC = b"LMCS"
_HEADER = struct.Struct("<4sHHQ32s")
HEADER_BYTES = _HEADER.size
_SIGNED_HEADER_BYTES = 16  # magic, format, reserved, body length: what the MAC covers
# The body's columns of the index: name -> (SavedIndex field, little-endian type); and
# "checksum" ("<u4"), "hash" (CHUNK_HASH_BYTES a chunk) beside them.
_COLUMNS = {"scope": ("scope_ids", "<u4"), "geometry": ("geometry_ids", "<u4"),
            "offset": ("offsets", "<u8"), "parent": ("parents", "<i8"),
            "recency": ("recency", "<u8")}
# Most bytes a snapshot of a pool can take: a chunk per ALIGNMENT bytes of pool at most,
# each its columns, plus the tables (scopes and geometries, bounded by those chunks too).
_BYTES_PER_CHUNK = sum(np.dtype(kind).itemsize for _, kind in _COLUMNS.values()) + 4 + \
    CHUNK_HASH_BYTES
_TABLE_BYTES_PER_CHUNK = 2048
_CHECKSUM_BATCH_BYTES = 64 * 1024**2  # a thread's task: many chunks, not one task a chunk


class BadSnapshot(ServerCondition):
    """A snapshot that is not adopted; the message says why (never what it holds)."""


def max_snapshot_bytes(capacity: int) -> int:
    """The largest snapshot a pool of `capacity` bytes can have: anything longer is refused
    before it is read."""
    chunks = capacity // ALIGNMENT
    return HEADER_BYTES + 4096 + chunks * (_BYTES_PER_CHUNK + _TABLE_BYTES_PER_CHUNK)


def encode(key: bytes, capacity: int, chunk_size: int, index: SavedIndex,
           checksums: np.ndarray) -> bytes:
    """The snapshot of `index` and its chunks' checksums, signed with `key`."""
    body = msgpack.packb({
        "capacity": capacity, "chunk_size": chunk_size, "count": len(index),
        "scopes": [list(scope) for scope in index.scopes],
        "geometries": [[g.layout, g.num_layers, list(g.block_shape), g.dtype, g.blocks_per_chunk]
                       for g in index.geometries],
        "hash": index.hashes,
        "checksum": np.ascontiguousarray(checksums, dtype="<u4").tobytes(),
        **{name: np.ascontiguousarray(getattr(index, field), dtype=kind).tobytes()
           for name, (field, kind) in _COLUMNS.items()},
    }, use_bin_type=True)
    header = _HEADER.pack(MAGIC, FORMAT, 0, len(body), bytes(32))[:_SIGNED_HEADER_BYTES]
    return _HEADER.pack(MAGIC, FORMAT, 0, len(body), _mac(key, header, body)) + body


def _mac(key: bytes, header: bytes | bytearray, body: bytes | memoryview) -> bytes:
    mac = hmac.new(key, header, hashlib.sha256)
    mac.update(body)
    return mac.digest()


def decode(keys: Sequence[bytes], raw: bytes | bytearray, capacity: int, chunk_size: int
           ) -> tuple[SavedIndex, np.ndarray]:
    """The index a snapshot holds and its chunks' checksums, if one of `keys` signed it
    and it describes chunks of this pool; raises BadSnapshot saying why not."""
    if len(raw) < HEADER_BYTES:
        raise BadSnapshot(f"the file is not a snapshot ({len(raw)} bytes, shorter than a "
                          f"snapshot's header)")
    magic, version, _, length, mac = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise BadSnapshot("the file is not a snapshot (no LMCS magic; servers before "
                          "format 3 wrote no magic)")
    if version not in READABLE_FORMATS:
        raise BadSnapshot(f"snapshot format {version} is not one this server reads "
                          f"({', '.join(map(str, sorted(READABLE_FORMATS)))})")
    body = memoryview(raw)[HEADER_BYTES:]
    if length != len(body):
        raise BadSnapshot(f"the snapshot's body is {len(body)} bytes, its header says {length}")
    signed = raw[:_SIGNED_HEADER_BYTES]
    if not any(hmac.compare_digest(mac, _mac(key, signed, body)) for key in keys):
        raise BadSnapshot("the snapshot is not signed with this server's snapshot key: it was "
                          "written by a server with another runtime directory, or by "
                          "someone else")
    try:
        return _parse(msgpack.unpackb(body, raw=False), capacity, chunk_size)
    except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as exc:
        raise BadSnapshot(f"the snapshot is malformed ({type(exc).__name__}: {exc})") from None


def _parse(body: dict, capacity: int, chunk_size: int) -> tuple[SavedIndex, np.ndarray]:
    if body["capacity"] != capacity:
        raise BadSnapshot(f"the snapshot is of a {body['capacity']}-byte pool, this one has "
                          f"{capacity} bytes")
    if body["chunk_size"] != chunk_size:
        raise BadSnapshot(f"the snapshot is of chunks of {body['chunk_size']} tokens, this "
                          f"server's are {chunk_size}")
    count = body["count"]
    if not isinstance(count, int) or not 0 <= count <= capacity // ALIGNMENT:
        raise ValueError(f"a count of {count!r} chunks")
    scopes = [_scope(entry) for entry in body["scopes"]]
    geometries = [_geometry(entry) for entry in body["geometries"]]
    columns = {}
    for name, (field, kind) in _COLUMNS.items():
        data = body[name]
        if not isinstance(data, bytes) or len(data) != count * np.dtype(kind).itemsize:
            raise ValueError(f"column {name!r} does not hold {count} values")
        columns[field] = np.frombuffer(data, dtype=kind)
    hashes, checksums = body["hash"], body["checksum"]
    if not isinstance(hashes, bytes) or len(hashes) != count * CHUNK_HASH_BYTES:
        raise ValueError(f"column 'hash' does not hold {count} hashes")
    if not isinstance(checksums, bytes) or len(checksums) != count * 4:
        raise ValueError(f"column 'checksum' does not hold {count} values")
    index = SavedIndex(scopes, geometries, hashes=hashes, **columns)
    _check(index, capacity)
    return index, np.frombuffer(checksums, dtype="<u4")


def _scope(entry: list) -> tuple[str, int, int, str]:
    model, world, worker, salt = entry
    if not (isinstance(model, str) and isinstance(salt, str) and type(world) is int
            and type(worker) is int and 0 <= worker < world):
        raise ValueError("a scope that names no model, kv worker and salt")
    return model, world, worker, salt


def _geometry(entry: list) -> Geometry:
    layout, num_layers, block_shape, dtype, blocks_per_chunk = entry
    if layout not in LAYOUTS or dtype not in DTYPES or type(num_layers) is not int \
            or type(blocks_per_chunk) is not int or num_layers < 1 or blocks_per_chunk < 1 \
            or not all(type(n) is int and n > 0 for n in block_shape):
        raise ValueError("a geometry this server does not know")
    return Geometry(layout, num_layers, tuple(block_shape), dtype, blocks_per_chunk)


def _check(index: SavedIndex, capacity: int) -> None:
    """Refuse an index whose chunks leave the pool, overlap, name a scope, geometry or
    parent that is not there, or repeat a key."""
    count = len(index)
    if not count:
        return
    if index.scope_ids.max() >= len(index.scopes) or \
            index.geometry_ids.max() >= len(index.geometries):
        raise ValueError("a chunk names a scope or geometry the snapshot lacks")
    if index.geometry_ids.size and max(g.chunk_bytes for g in index.geometries) > capacity:
        raise ValueError("a geometry larger than the pool")
    offsets, sizes = index.offsets.astype(np.int64), index.nbytes
    ends = offsets + -(-sizes // ALIGNMENT) * ALIGNMENT
    if (offsets % ALIGNMENT).any() or (ends > capacity).any():
        raise BadSnapshot("the snapshot's chunks leave the pool")
    order = np.argsort(offsets, kind="stable")
    if (offsets[order][1:] < ends[order][:-1]).any():
        raise BadSnapshot("the snapshot's chunks overlap")
    parents = index.parents
    has_parent = parents >= 0
    if (parents < -1).any() or (parents >= np.arange(count)).any():
        raise ValueError("a chunk names a parent that does not come before it")
    if (index.scope_ids[parents[has_parent]] != index.scope_ids[has_parent]).any():
        raise ValueError("a chunk's parent is of another model, kv worker or salt")
    # A key twice: 64 bits of each key sorted find the candidates (a sort of structured
    # keys costs seconds a million), which are then compared whole.
    words = np.frombuffer(index.hashes, dtype="<u8").reshape(count, -1)
    fingerprints = words[:, 0] ^ (words[:, 1] * 0x9E3779B97F4A7C15) ^ index.scope_ids
    order = np.argsort(fingerprints, kind="stable")
    twins = order[np.flatnonzero(fingerprints[order][1:] == fingerprints[order][:-1])]
    if len(twins):
        width = CHUNK_HASH_BYTES
        candidates = set(fingerprints[twins].tolist())
        seen = set()
        for i in np.flatnonzero(np.isin(fingerprints, list(candidates))).tolist():
            key = (int(index.scope_ids[i]), index.hashes[i * width:(i + 1) * width])
            if key in seen:
                raise BadSnapshot("the snapshot names a chunk twice")
            seen.add(key)


def checksums(pool: memoryview, offsets: np.ndarray, sizes: np.ndarray, threads: int,
              fault_in: Callable[[int, int], None] | None = None) -> tuple[np.ndarray, float]:
    """CRC-32 of each extent (offsets[i], sizes[i]) of the pool, and the CPU seconds the
    sums took (what a core's speed is read from, whatever else shares the cores).

    On `threads` threads, each taking runs of chunks of about _CHECKSUM_BATCH_BYTES in the
    pool's order (zlib lets go of the GIL while it sums a chunk; a task a chunk cost more
    than the sums), each run first faulted in with `fault_in(offset, length)` where the
    pool is not yet (a start: one call for a run costs less than a fault a page; pread,
    a copy, costs more than both)."""
    order = np.argsort(offsets, kind="stable")
    starts, lengths = offsets[order].tolist(), sizes[order].tolist()
    found = np.zeros(len(starts), dtype=np.uint32)
    ends = np.cumsum(lengths, dtype=np.int64)
    cuts = np.searchsorted(ends, np.arange(_CHECKSUM_BATCH_BYTES, int(ends[-1]) if len(ends)
                                           else 0, _CHECKSUM_BATCH_BYTES)).tolist()
    bounds = list(zip([0, *cuts], [*cuts, len(starts)]))

    def batch(span: tuple[int, int]) -> float:
        cpu = time.thread_time()
        first, stop = span
        if fault_in is not None and stop > first:
            fault_in(starts[first], starts[stop - 1] + lengths[stop - 1] - starts[first])
        crc = zlib.crc32
        found[first:stop] = [crc(pool[o:o + n]) for o, n in zip(starts[first:stop],
                                                               lengths[first:stop])]
        return time.thread_time() - cpu
    if threads <= 1 or len(bounds) <= 1:
        cpu_seconds = sum(map(batch, bounds))
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="snapshot-checksums") as workers:
            cpu_seconds = sum(workers.map(batch, bounds))
    result = np.empty_like(found)
    result[order] = found
    return result, cpu_seconds
