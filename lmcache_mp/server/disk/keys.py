"""What a chunk is called on disk: a 16-byte digest of everything that makes its bytes differ."""

from __future__ import annotations

import hashlib

from ..cache.chunk import ChunkKey

KEY_BYTES = 16
NO_KEY = bytes(KEY_BYTES)  # the journal's parent of a prompt's first chunk


def disk_key(space: str, key: ChunkKey) -> bytes:
    """`space`: lower.names.namespace(model, geometry), which names the model and the layout
    of the chunk's bytes; the salt, kv worker and chunk hash name the rest."""
    head = f"{space}\0{key.cache_salt}\0{key.kv_world_size}.{key.kv_worker_id}\0".encode()
    return hashlib.blake2b(head + key.chunk_hash, digest_size=KEY_BYTES,
                           person=b"lmcache-mp disk").digest()
