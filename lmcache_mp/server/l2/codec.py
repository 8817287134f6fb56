"""L2 keys and values: what a chunk is called in L2, and the checked form its bytes take there.

Key: `lmcache-mp:1:<namespace>:<salt>:<kv_world_size>.<kv_worker_id>:<chunk hash>`, where
`namespace` (lower/names.py) is a digest of the model and the chunk geometry, `salt` a digest of the
cache_salt (salts stay apart, and a salt's characters never reach the key), and the
chunk hash is in hex. The key has no hash tag: a chunk hash already names a whole
prefix, so keys spread over a cluster's slots, and a pipeline reaches each node at once.

Value: a header, then the chunk's bytes. A server without --l2-key-file writes format 1:
magic, version, payload size and a CRC-32 of the key and the payload, which catches
corruption and a value copied under another key, but which anyone can compute. A server
with a key writes format 2: magic, version, payload size, the id of the key that signed
it and an HMAC-SHA256 of the header, the key and the payload, which no one without the
key can make. A server reads only the format it writes (with a key, under one of its
keys): anything else is not a chunk, and the reader treats it as a miss.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from abc import ABC, abstractmethod

from ..cache.chunk import ChunkKey
from ..lower.names import digest
from .keyfile import L2Keys

KEY_PREFIX = b"lmcache-mp:1:"
VALUE_MAGIC = b"LMCV"
KEY_ID_BYTES = 8


def l2_key(space: str, key: ChunkKey) -> bytes:
    return (KEY_PREFIX + f"{space}:{digest(key.cache_salt)}:{key.kv_world_size}."
            f"{key.kv_worker_id}:{key.chunk_hash.hex()}".encode())


def key_id(secret: bytes) -> bytes:
    """What names a MAC key in the values it signed, so that a reader takes the right one at
    once: a digest, which tells nothing of the key."""
    return hashlib.sha256(b"lmcache-mp L2 key id\0" + secret).digest()[:KEY_ID_BYTES]


class ValueFormat(ABC):
    """How one server seals the values it writes and checks those it reads: one format."""

    version: int
    header: struct.Struct  # starts with magic, version, reserved (0), payload size

    @property
    def header_bytes(self) -> int:
        return self.header.size

    def buffer(self, size: int) -> bytearray:
        """A value of `size` payload bytes to fill after the header: seal() finishes it."""
        return bytearray(self.header.size + size)

    def seal(self, key: bytes, value: bytearray) -> None:
        """Write the header of a buffer() whose payload has been written (CPU-heavy: off the
        loop)."""
        view = memoryview(value)
        self.seal_header(key, view[:self.header.size], view[self.header.size:])

    @abstractmethod
    def seal_header(self, key: bytes, header: memoryview | bytearray,
                    payload: memoryview) -> None:
        """Write into `header` (header_bytes long) the header of a value of this key and
        payload, which may lie elsewhere (a pool extent, sent beside it): CPU-heavy."""

    @abstractmethod
    def _vouched(self, key: bytes, header: bytes | bytearray | memoryview, fields: tuple,
                 payload: memoryview) -> bool:
        """Whether the header's check (its `fields`, unpacked) holds for this key and payload."""

    @abstractmethod
    def describe(self) -> str:
        """How values are checked, for the start-up log."""

    def payload(self, key: bytes, value: bytes, size: int) -> memoryview | None:
        """The payload of a value read back for `key`, if it is an intact chunk of `size`
        bytes in this format that its check vouches for; None otherwise (CPU-heavy: off the
        loop)."""
        if len(value) != self.header.size + size:
            return None
        view = memoryview(value)
        payload = view[self.header.size:]
        return payload if self.vouches(key, view[:self.header.size], payload) else None

    def vouches(self, key: bytes, header: bytes | bytearray | memoryview,
                payload: memoryview) -> bool:
        """Whether `header` (header_bytes long) is this format's header of an intact value
        of this key and payload, which may lie apart from it (CPU-heavy: off the loop)."""
        fields = self.header.unpack_from(header)
        magic, version, _, stated = fields[:4]
        return (magic == VALUE_MAGIC and version == self.version and stated == len(payload)
                and self._vouched(key, header, fields, payload))


class CrcFormat(ValueFormat):
    """Format 1, without a key: catches corruption, not a forgery."""

    version = 1
    header = struct.Struct("<4sHHQI")  # magic, version, reserved, payload size, crc32

    @staticmethod
    def _checksum(key: bytes, payload: memoryview) -> int:
        # The key is in the checksum: a value copied under another key does not verify.
        return zlib.crc32(payload, zlib.crc32(key))

    def seal_header(self, key: bytes, header: memoryview | bytearray,
                    payload: memoryview) -> None:
        self.header.pack_into(header, 0, VALUE_MAGIC, self.version, 0, len(payload),
                              self._checksum(key, payload))

    def _vouched(self, key: bytes, header: bytes | bytearray | memoryview, fields: tuple,
                 payload: memoryview) -> bool:
        return fields[4] == self._checksum(key, payload)

    def describe(self) -> str:
        return "values checked by CRC-32 only"


_SIGNED = struct.Struct("<4sHHQ8s")  # magic, version, reserved, payload size, key id


class MacFormat(ValueFormat):
    """Format 2, with --l2-key-file: an HMAC-SHA256 (faster here than keyed BLAKE2b: SHA
    instructions) by the first key; a value verifies under any of the keys."""

    version = 2
    header = struct.Struct(_SIGNED.format + "32s")  # ... and the MAC

    def __init__(self, keys: L2Keys):
        self._signing = keys.signing
        self._signing_id = key_id(keys.signing)
        self._keys = {key_id(secret): secret for secret in keys.verifying()}

    @staticmethod
    def _mac(secret: bytes, key: bytes, header: bytes | bytearray | memoryview,
             payload: memoryview) -> bytes:
        # The signed header states the payload's size: key and payload cannot trade bytes.
        mac = hmac.new(secret, memoryview(header)[:_SIGNED.size], "sha256")
        mac.update(key)
        mac.update(payload)  # lets go of the GIL: the two offload threads sign at once
        return mac.digest()

    def seal_header(self, key: bytes, header: memoryview | bytearray,
                    payload: memoryview) -> None:
        _SIGNED.pack_into(header, 0, VALUE_MAGIC, self.version, 0, len(payload),
                          self._signing_id)
        header[_SIGNED.size:self.header.size] = self._mac(self._signing, key, header, payload)

    def _vouched(self, key: bytes, header: bytes | bytearray | memoryview, fields: tuple,
                 payload: memoryview) -> bool:
        secret = self._keys.get(fields[4])
        return secret is not None and hmac.compare_digest(
            fields[5], self._mac(secret, key, header, payload))

    def describe(self) -> str:
        accepted = [key.hex() for key in self._keys if key != self._signing_id]
        return (f"values signed with HMAC-SHA256 by key {self._signing_id.hex()}"
                + (f"; those by key {accepted[0]} accepted too" if accepted else ""))


def value_format(keys: L2Keys | None) -> ValueFormat:
    """The format of a server with these --l2-key-file keys (None: without one)."""
    return CrcFormat() if keys is None else MacFormat(keys)
