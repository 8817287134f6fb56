"""L2 keys and values: what a chunk is called in L2, and the checked form its bytes take there.

Key: `lmcache-mp:1:<namespace>:<salt>:<kv_world_size>.<kv_worker_id>:<chunk hash>`, where
`namespace` is a digest of the model and the chunk geometry, `salt` a digest of the
cache_salt (salts stay apart, and a salt's characters never reach the key), and the
chunk hash is in hex. The key has no hash tag: a chunk hash already names a whole
prefix, so keys spread over a cluster's slots, and a pipeline reaches each node at once.

Value: a 20-byte header (magic, format version, payload size, CRC-32 of the key and the
payload), then the chunk's bytes. A value whose header, size or checksum is wrong is
not a chunk: the reader treats it as a miss.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Hashable

from ..store import ChunkKey

KEY_PREFIX = b"lmcache-mp:1:"
VALUE_MAGIC = b"LMCV"
VALUE_VERSION = 1
_HEADER = struct.Struct("<4sHHQI")  # magic, version, reserved, payload size, crc32
HEADER_BYTES = _HEADER.size


def _digest(*parts: object) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


def namespace(model: str, geometry: Hashable) -> str:
    """The digest of what makes a chunk's bytes differ for the same tokens."""
    return _digest(model, geometry)


def l2_key(space: str, key: ChunkKey) -> bytes:
    return (KEY_PREFIX + f"{space}:{_digest(key.cache_salt)}:{key.kv_world_size}."
            f"{key.kv_worker_id}:{key.chunk_hash.hex()}".encode())


def _checksum(key: bytes, payload: bytes | memoryview) -> int:
    # The key is in the checksum: a value copied under another key does not verify.
    return zlib.crc32(payload, zlib.crc32(key))


def value_buffer(size: int) -> bytearray:
    """A value of `size` payload bytes to fill after the header: write_header() finishes it."""
    return bytearray(HEADER_BYTES + size)


def write_header(key: bytes, value: bytearray) -> None:
    """Seal a value_buffer() whose payload has been written (CPU-heavy: off the loop)."""
    payload = memoryview(value)[HEADER_BYTES:]
    _HEADER.pack_into(value, 0, VALUE_MAGIC, VALUE_VERSION, 0, len(payload),
                      _checksum(key, payload))


def verified_payload(key: bytes, value: bytes, size: int) -> memoryview | None:
    """The payload of a value read back for `key`, if it is an intact chunk of `size` bytes;
    None otherwise (CPU-heavy: off the loop)."""
    if len(value) != HEADER_BYTES + size:
        return None
    magic, version, _, stated, checksum = _HEADER.unpack_from(value)
    payload = memoryview(value)[HEADER_BYTES:]
    if (magic != VALUE_MAGIC or version != VALUE_VERSION or stated != size
            or _checksum(key, payload) != checksum):
        return None
    return payload
