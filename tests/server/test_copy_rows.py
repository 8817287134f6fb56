"""Gather and scatter through [outer, blocks, row] word views (registry._as_rows), the
numpy row scatter, and their fallbacks: the same bytes as a plain index_select, whatever
the row width, alignment or layer layout."""

import pytest
import torch

from lmcache_mp.protocol import SKIP_BLOCK
from lmcache_mp.server.registry import Geometry, KVCacheInstance


def instance(block_shape: tuple[int, ...], layers: int, num_blocks: int, dtype: torch.dtype,
             stacked: bool, offset: int = 0, gap: int = 0
             ) -> tuple[KVCacheInstance, torch.Tensor]:
    """A cache in one buffer, `offset` items in (an unaligned start) and `gap` items between
    layers, as the registry maps one."""
    shape = ((*block_shape[:1], num_blocks, *block_shape[1:]) if len(block_shape) == 4
             else (num_blocks, *block_shape))
    per_layer = torch.Size(shape).numel()
    buffer = torch.randint(-1000, 1000, (offset + layers * (per_layer + gap),)).to(dtype)
    typed = buffer[offset:].view(layers, per_layer + gap)[:, :per_layer].unflatten(1, shape)
    geometry = Geometry("mha" if len(block_shape) == 4 else "mla", layers, block_shape,
                        str(dtype).removeprefix("torch."), 4)
    cache = KVCacheInstance(1, b"", b"", "m", 1, 0, 0, "", num_blocks, geometry,
                            list(typed), typed if stacked else None, [], 0.0)
    return cache, typed


SHAPES = [((2, 16, 2, 64), torch.float16, 0, 0),  # W2-like: 8-byte words, numpy scatter
          ((2, 16, 2, 64), torch.float16, 0, 8),  # layers apart: no flat rows, index_copy_
          ((2, 1, 1, 3), torch.float16, 0, 0),  # 6-byte rows: 2-byte words
          ((2, 1, 1, 3), torch.float16, 1, 0),  # an odd start: 2-byte words
          ((5, 7), torch.uint8, 3, 1),  # MLA, 35-byte rows at an odd start: bytes
          ((2, 4, 2, 8), torch.float32, 0, 0)]


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("block_shape,dtype,offset,gap", SHAPES)
def test_gather_and_scatter_move_exact_bytes(block_shape, dtype, offset, gap, stacked):
    cache, typed = instance(block_shape, 3, 20, dtype, stacked, offset, gap)
    block_dim = cache.geometry.block_dim + 1
    ids = torch.tensor([7, 0, 19, 3])
    out = torch.empty(cache.geometry.chunk_shape, dtype=dtype)
    cache.gather(ids, out)
    assert torch.equal(out, typed.index_select(block_dim, ids))

    source = torch.randint(-1000, 1000, cache.geometry.chunk_shape).to(dtype)
    before = typed.clone()
    targets = torch.tensor([4, 11, 2, 18])
    cache.scatter(targets, source)
    assert torch.equal(typed.index_select(block_dim, targets), source)
    untouched = [b for b in range(20) if b not in targets.tolist()]
    assert torch.equal(typed.index_select(block_dim, torch.tensor(untouched)),
                       before.index_select(block_dim, torch.tensor(untouched)))

    # SKIP_BLOCK leaves its block alone; the others land
    skipping = torch.tensor([5, SKIP_BLOCK, 6, 9])
    before = typed.clone()
    cache.scatter(skipping, source.flip(0), has_skips=True)
    kept = torch.tensor([0, 2, 3])
    assert torch.equal(typed.index_select(block_dim, torch.tensor([5, 6, 9])),
                       source.flip(0).index_select(block_dim, kept))
    others = [b for b in range(20) if b not in (5, 6, 9)]
    assert torch.equal(typed.index_select(block_dim, torch.tensor(others)),
                       before.index_select(block_dim, torch.tensor(others)))
