"""SGLang page keys as the server's 16-byte chunk hashes, a batch at a time."""

from __future__ import annotations

import hashlib

import numpy as np

from ...protocol import CHUNK_HASH_BYTES

# SGLang 0.5.23's page key: a SHA-256 hexdigest (64 lowercase hex digits), chained over the
# page's tokens and its prefix and seeded by the request's extra key and salt.
_SHA256_HEX = 64
_SHA256_BYTES = _SHA256_HEX // 2
# A digest as numpy reads it: its first CHUNK_HASH_BYTES, the chunk hash, as one value.
_HEADS = np.dtype({"names": ["head"], "formats": [f"V{CHUNK_HASH_BYTES}"],
                   "itemsize": _SHA256_BYTES})
# Keys of any other form are hashed, under a personalization of their own: apart from the
# digests taken as they are.
_OTHER_KEYS = b"lmcache-mp-sgl"
_UPPER_HEX = "ABCDEF"  # fromhex takes them too: a key that has one is not SGLang's digest


def packed_hashes(keys: list[str]) -> bytes:
    """The keys' chunk hashes back to back (as a LOOKUP or STORE item carries them): per key,
    the first 16 bytes of the SHA-256 digest it spells in hex (already uniform: hashing it
    again would add nothing but time), or BLAKE2b-128 of the UTF-8 text of any other key.
    A batch of SGLang keys is decoded in a few calls, with no Python work per key."""
    digests = _digests(keys)
    if digests is None:
        return b"".join(chunk_hash(key) for key in keys)
    return np.frombuffer(digests, _HEADS)["head"].tobytes()


def chunk_hash(key: str) -> bytes:
    """One key's chunk hash (as packed_hashes)."""
    digest = _digests([key])
    if digest is not None:
        return digest[:CHUNK_HASH_BYTES]
    return hashlib.blake2b(key.encode(), digest_size=CHUNK_HASH_BYTES,
                           person=_OTHER_KEYS).digest()


def _digests(keys: list[str]) -> bytes | None:
    """The SHA-256 digests the keys spell, back to back; None unless every key is 64
    lowercase hex digits. A few passes in C over the batch, no Python call a key."""
    count = len(keys)
    # Joined by spaces, which fromhex skips. Digits alone make whole bytes, so 32 bytes a
    # key mean no key holds whitespace; then a space at every 65th place, in a text of
    # 65 characters a key less one, means each key is 64 long (a 63-digit key beside a
    # 65-digit one would move the first space).
    joined = " ".join(keys)
    if (len(joined) != (_SHA256_HEX + 1) * count - 1
            or joined[_SHA256_HEX::_SHA256_HEX + 1] != " " * (count - 1)
            or any(digit in joined for digit in _UPPER_HEX)):
        return None
    try:
        digests = bytes.fromhex(joined)
    except ValueError:
        return None
    return digests if len(digests) == _SHA256_BYTES * count else None
