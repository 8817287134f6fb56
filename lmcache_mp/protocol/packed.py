"""Packed arrays: a message's chunk hashes, block ids and kv worker ids, each array one msgpack bin.

Large arrays travel as one bin, not as msgpack arrays (docs/protocol.md, "Packed arrays"):
one value to decode and count however many chunks an item names.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable

from ..errors import BadRequest

CHUNK_HASH_BYTES = 16
BLOCK_ID_BYTES = 4  # int32, little-endian
WORKER_ID_BYTES = 2  # uint16, little-endian: a kv worker id (below MAX_KV_WORLD_SIZE)
SKIP_BLOCK = -1  # in RETRIEVE block_ids: leave this block of the chunk unwritten


def pack_hashes(hashes: list[bytes]) -> bytes:
    return b"".join(hashes)


def check_hashes(packed: bytes, path: str) -> None:
    """BadRequest, naming the field at `path`, unless `packed` holds whole hashes."""
    if len(packed) % CHUNK_HASH_BYTES:
        raise BadRequest(f"`{path}`: length {len(packed)} is not a multiple of {CHUNK_HASH_BYTES}")


def unpack_hashes(packed: bytes, path: str) -> list[bytes]:
    check_hashes(packed, path)
    return list(split_hashes(packed))


# Up to this many hashes, split_hashes() unpacks with one cached struct format, in C:
# ~10-20 ns a hash, where slicing in a Python loop took 50-130 (a batched LOOKUP's 512
# hashes spent more time being split than being looked up).
_SPLIT_IN_C = 1024


@functools.lru_cache(maxsize=64)
def _hash_splitter(count: int) -> Callable[[bytes], tuple[bytes, ...]]:
    return struct.Struct(f"{CHUNK_HASH_BYTES}s" * count).unpack


def split_hashes(packed: bytes) -> tuple[bytes, ...]:
    """unpack_hashes() for a length already checked."""
    count = len(packed) // CHUNK_HASH_BYTES
    if count <= _SPLIT_IN_C:
        return _hash_splitter(count)(packed)
    return tuple(packed[i:i + CHUNK_HASH_BYTES] for i in range(0, len(packed), CHUNK_HASH_BYTES))


def pack_block_ids(block_ids: list[int]) -> bytes:
    return struct.pack(f"<{len(block_ids)}i", *block_ids)


def unpack_block_ids(packed: bytes, path: str) -> list[int]:
    if len(packed) % BLOCK_ID_BYTES:
        raise BadRequest(f"`{path}`: length {len(packed)} is not a multiple of {BLOCK_ID_BYTES}")
    return list(struct.unpack(f"<{len(packed) // BLOCK_ID_BYTES}i", packed))


def pack_worker_ids(worker_ids: list[int]) -> bytes:
    return struct.pack(f"<{len(worker_ids)}H", *worker_ids)


def unpack_worker_ids(packed: bytes, path: str) -> list[int]:
    if len(packed) % WORKER_ID_BYTES:
        raise BadRequest(f"`{path}`: length {len(packed)} is not a multiple of {WORKER_ID_BYTES}")
    return list(struct.unpack(f"<{len(packed) // WORKER_ID_BYTES}H", packed))
