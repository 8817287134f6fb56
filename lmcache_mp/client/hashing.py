"""Chunk keys: a rolling 128-bit hash over token ids that every engine on every machine agrees on."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_SEED = hashlib.blake2b(b"lmcache-mp chunk hash v1", digest_size=16).digest()


def chunk_hashes(token_ids: Sequence[int], chunk_size: int) -> list[bytes]:
    """One 16-byte hash per full chunk of `token_ids`; a partial last chunk gets none.

    hash[i] = BLAKE2b-128(hash[i-1] || token ids of chunk i as uint32 little-endian),
    with hash[-1] = HASH_SEED, so each hash names the whole prefix that ends with its chunk.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    hashes = []
    previous = HASH_SEED
    pack = struct.Struct(f"<{chunk_size}I").pack
    for start in range(0, len(token_ids) - chunk_size + 1, chunk_size):
        data = pack(*token_ids[start:start + chunk_size])
        previous = hashlib.blake2b(previous + data, digest_size=16).digest()
        hashes.append(previous)
    return hashes
