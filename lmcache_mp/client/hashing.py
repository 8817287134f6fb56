"""Chunk keys: a rolling 128-bit hash over token ids that every engine everywhere agrees on."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_SEED = hashlib.blake2b(b"lmcache-mp chunk hash v1", digest_size=16).digest()


def chunk_hashes(token_ids: Sequence[int], chunk_size: int,
                 extra_keys: Sequence[bytes] | None = None) -> list[bytes]:
    """One 16-byte hash per full chunk of `token_ids`; a partial last chunk gets none.

    hash[i] = BLAKE2b-128(hash[i-1] || token ids of chunk i as uint32 little-endian
    || extra_keys[i]), with hash[-1] = HASH_SEED, so each hash names the whole prefix that
    ends with its chunk, and whatever extra key material went into it or any chunk before.

    `extra_keys[i]`: what else the KV of chunk i depends on besides its tokens (a LoRA
    adapter, the content hashes of the images whose placeholder tokens it holds), encoded
    by the caller so that different material gives different bytes; b"" (or a list shorter
    than the chunks) adds nothing, and the hash is the plain token hash.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    extra_keys = extra_keys or ()
    hashes = []
    previous = HASH_SEED
    pack = struct.Struct(f"<{chunk_size}I").pack
    for index, start in enumerate(range(0, len(token_ids) - chunk_size + 1, chunk_size)):
        data = previous + pack(*token_ids[start:start + chunk_size])
        if index < len(extra_keys):
            data += extra_keys[index]
        previous = hashlib.blake2b(data, digest_size=16).digest()
        hashes.append(previous)
    return hashes
