"""Every dtype a cache may have goes through a real server and back byte for byte.

Copies move bytes as integers of the dtype's item size, so float8 (which has no
index_copy_ kernel) and every other dtype take the same path. The GPU path's twin is
tests/server/copy/test_streams.py::test_every_dtype_round_trips_through_the_stream_copier.
"""

import pytest
import torch

from lmcache_mp.client import SKIP_BLOCK, CacheClient, SharedKVCache, StoreStatus, TransferItem
from lmcache_mp.server.memory.geometry import DTYPES

from ...workers import BLOCKS_PER_CHUNK, MODEL, chunk_blocks, make_cache, prompt

NUM_BLOCKS = 4 * BLOCKS_PER_CHUNK
# (layout, layers, heads, head_dim): small blocks take index_copy_, big ones (256 KiB of a
# block across layers at one byte an item) the server's per-block copy_.
SHAPES = {"mha": ("mha", 2, 2, 16), "mla": ("mla", 3, 1, 48), "big": ("mha", 4, 8, 128)}


def bytes_of(cache: SharedKVCache, block_ids: list[int]) -> torch.Tensor:
    """The blocks' bytes (random bytes hold NaNs, which never compare equal as floats)."""
    index = torch.tensor(block_ids)
    return torch.stack([layer.view(torch.uint8).index_select(cache.block_dim(), index)
                        for layer in cache.layers])


# Every dtype in both layouts; the per-block path once is enough, with one-byte items.
CASES = [(dtype, shape) for dtype in DTYPES for shape in SHAPES
         if shape != "big" or DTYPES[dtype].itemsize == 1]


@pytest.mark.parametrize("dtype,shape", CASES)
def test_every_dtype_round_trips_byte_exact(server, dtype, shape):
    layout, layers, heads, head_dim = SHAPES[shape]
    tag = 1000 + 10 * list(DTYPES).index(dtype) + list(SHAPES).index(shape)
    hashes = prompt(tag, 2)
    source, target = chunk_blocks([0, 1]), chunk_blocks([3, 2])
    held = target[1]
    target[1] = SKIP_BLOCK  # the engine holds it already: left alone
    cache_shape = dict(layout=layout, num_layers=layers, block_size=16, heads=heads,
                       head_dim=head_dim, dtype=DTYPES[dtype])
    with (make_cache(NUM_BLOCKS, tag, cache_shape) as mine,
          make_cache(NUM_BLOCKS, None, cache_shape) as theirs,
          CacheClient(server.url, timeout=30) as client):
        registrations = [client.register_kv_cache(cache.handles(), model=MODEL, layout=layout,
                                                  block_size=16) for cache in (mine, theirs)]
        assert client.store(registrations[0], [TransferItem.build("s", hashes, source)]) == [
            bytes([StoreStatus.STORED] * 2)]
        assert client.retrieve(registrations[1], [TransferItem.build("r", hashes, target)]) == [2]
        written = [i for i, block in enumerate(target) if block != SKIP_BLOCK]
        assert torch.equal(bytes_of(theirs, [target[i] for i in written]),
                           bytes_of(mine, [source[i] for i in written]))
        assert bool((bytes_of(theirs, [held]) == 0).all())
        for registration in registrations:
            client.unregister(registration)
