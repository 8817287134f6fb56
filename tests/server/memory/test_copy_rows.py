"""Gather and scatter through [outer, blocks, row] word views (registry._as_rows) and their
fallbacks, and through HostRows' numpy rows (caches in CPU memory): the same bytes as a
plain index_select, whatever the row width, alignment or layer layout."""

import numpy as np
import pytest
import torch

from lmcache_mp.protocol import SKIP_BLOCK
from lmcache_mp.server.cache.chunk import Chunk, ChunkKey
from lmcache_mp.server.memory.geometry import Geometry
from lmcache_mp.server.memory.host_rows import HostRows
from lmcache_mp.server.memory.instance import KVCacheInstance
from lmcache_mp.server.ops.transfers import COPY_RUN_BYTES, copy_runs, per_chunk


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


SHAPES = [((2, 16, 2, 64), torch.float16, 0, 0),  # W2-like: 8-byte words
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
    before = typed.clone()
    cache.scatter(torch.tensor([SKIP_BLOCK] * 4), source, has_skips=True)  # all skipped
    assert torch.equal(typed, before)


# -- HostRows: the numpy row copies the dispatcher uses for caches in CPU memory ----------

def _mha_layers(layers: int, num_blocks: int, physical: tuple[int, ...],
                dtype: torch.dtype = torch.float16, block_size: int = 4, heads: int = 2,
                head_dim: int = 32, stacked: bool = False):
    """Layer tensors of logical shape [2, blocks, block_size, heads, head_dim] whose memory
    is laid out in the `physical` order of those dims (vLLM's CPU backend: blocks first, K
    and V interleaved per head row), in one buffer; the stacked view when asked."""
    logical = (2, num_blocks, block_size, heads, head_dim)
    shape = tuple(logical[d] for d in physical)
    buffer = torch.randint(-1000, 1000, (layers, *shape)).to(dtype)
    back = [physical.index(d) for d in range(5)]
    views = [buffer[layer].permute(*back) for layer in range(layers)]
    return views, (buffer.permute(0, *(b + 1 for b in back)) if stacked else None)


def _host_geometry(layers: list[torch.Tensor], blocks_per_chunk: int) -> Geometry:
    _, _, block_size, heads, head_dim = layers[0].shape
    return Geometry("mha", len(layers), (2, block_size, heads, head_dim),
                    str(layers[0].dtype).removeprefix("torch."), blocks_per_chunk)


def _chunk_of(layers: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The canonical chunk: [layers, 2, blocks, ...] in logical order."""
    return torch.stack([layer.index_select(1, torch.tensor(ids)) for layer in layers])


LAYOUTS = [((0, 1, 2, 3, 4), False),  # contiguous per layer: a block's K (or V) is one row
           ((0, 1, 2, 3, 4), True),  # the same, stacked: one part
           ((1, 3, 2, 0, 4), False)]  # vLLM CPU: [blocks, heads, tokens, K/V, head_dim]


@pytest.mark.parametrize("physical,stacked", LAYOUTS)
def test_host_rows_move_the_canonical_chunk_bytes(physical, stacked):
    layers, stack = _mha_layers(3, 20, physical, stacked=stacked)
    host = HostRows.of(layers, stack, block_dim=1)
    assert host is not None
    geometry = _host_geometry(layers, 2)
    ids = np.array([[7, 0], [19, 3]], dtype=np.int64)
    rows = host.rows(ids)
    pool = np.zeros(2 * geometry.chunk_bytes, dtype=np.uint8)
    for c in range(2):
        host.gather(rows[c], host.chunk(pool[c * geometry.chunk_bytes:][:geometry.chunk_bytes]))
        got = torch.from_numpy(pool[c * geometry.chunk_bytes:][:geometry.chunk_bytes].copy())
        assert torch.equal(got.view(layers[0].dtype).view(geometry.chunk_shape),
                           _chunk_of(layers, ids[c].tolist()))

    before = [layer.clone() for layer in layers]
    source = torch.randint(-1000, 1000, geometry.chunk_shape).to(layers[0].dtype)
    host.scatter(host.rows(np.array([[4, 11]]))[0], host.chunk(source.view(-1).view(
        torch.uint8).numpy()))
    assert torch.equal(_chunk_of(layers, [4, 11]), source)
    others = [b for b in range(20) if b not in (4, 11)]
    assert all(torch.equal(layer.index_select(1, torch.tensor(others)),
                           old.index_select(1, torch.tensor(others)))
               for layer, old in zip(layers, before))

    # SKIP_BLOCK leaves its block alone, and the other lands
    before = [layer.clone() for layer in layers]
    host.scatter_skipping(np.array([SKIP_BLOCK, 9]), host.chunk(
        source.flip(2).contiguous().view(-1).view(torch.uint8).numpy()))
    assert torch.equal(_chunk_of(layers, [9]), source.flip(2)[:, :, 1:2])
    assert all(torch.equal(layer.index_select(1, torch.tensor([0, 5])),
                           old.index_select(1, torch.tensor([0, 5])))
               for layer, old in zip(layers, before))
    assert host.rows(np.zeros((0, 2), dtype=np.int64)).shape[0] == 0  # an empty item


@pytest.mark.parametrize("head_dim", [32, 128], ids=["narrow-rows", "wide-rows"])
def test_a_chunk_whose_blocks_are_all_skipped_writes_nothing(head_dim):
    """The engine holds every block of the chunk: its copy writes nothing, and succeeds
    (rows from HostRows.WIDE_ROW_BYTES up are assigned as byte rows, narrower ones put)."""
    layers, _ = _mha_layers(3, 20, (0, 1, 2, 3, 4), head_dim=head_dim)
    host = HostRows.of(layers, None, block_dim=1)
    assert host is not None
    geometry = _host_geometry(layers, 2)
    assert (host._byte_rows is not None) == (head_dim == 128)
    before = [layer.clone() for layer in layers]
    source = torch.randint(-1000, 1000, geometry.chunk_shape).to(layers[0].dtype)
    host.scatter_skipping(np.array([SKIP_BLOCK, SKIP_BLOCK]), host.chunk(
        source.view(-1).view(torch.uint8).numpy()))
    assert all(torch.equal(layer, old) for layer, old in zip(layers, before))


def test_a_run_of_chunks_moves_as_each_chunk_would():
    """The dispatcher copies adjacent chunks of a one-part cache with one gather (or scatter)
    of their rows back to back: the bytes of each chunk, in turn."""
    layers, stack = _mha_layers(3, 20, (0, 1, 2, 3, 4), stacked=True)
    host = HostRows.of(layers, stack, block_dim=1)
    assert host is not None and len(host.parts) == 1
    geometry = _host_geometry(layers, 2)
    ids = np.array([[7, 0], [19, 3], [2, 5]], dtype=np.int64)
    rows = host.rows(ids)
    pool = np.zeros(3 * geometry.chunk_bytes, dtype=np.uint8)
    host.gather(rows[0:3].reshape(-1), host.chunk(pool))
    for c in range(3):
        got = torch.from_numpy(pool[c * geometry.chunk_bytes:][:geometry.chunk_bytes].copy())
        assert torch.equal(got.view(layers[0].dtype).view(geometry.chunk_shape),
                           _chunk_of(layers, ids[c].tolist()))
    targets = np.array([[4, 11], [12, 13], [1, 6]], dtype=np.int64)
    host.scatter(host.rows(targets).reshape(-1), host.chunk(pool))
    for c in range(3):
        assert torch.equal(_chunk_of(layers, targets[c].tolist()),
                           _chunk_of(layers, ids[c].tolist()))


def test_copy_runs_join_an_items_adjacent_chunks_up_to_the_run_size():
    size = 1 << 20
    chunk = [Chunk(ChunkKey("m", 1, 0, "", bytes(16)), offset * size, size, None, tier=tier)
             for offset, tier in [(0, 0), (1, 0), (2, 0), (5, 0), (6, 0), (7, 1), (8, 1)]]
    places = [(0, 0, chunk[0]), (0, 1, chunk[1]), (0, 2, chunk[2]),  # one run
              (0, 3, chunk[3]),  # a hole before it
              (1, 0, chunk[4]),  # another item, right after it in the pool
              (1, 1, chunk[5]), (1, 2, chunk[6])]  # another tier
    assert copy_runs(places, lambda place: True) == [(0, 3), (3, 1), (4, 1), (5, 2)]
    assert copy_runs(places, lambda place: place[2] is not chunk[1]) == [
        (0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 2)]
    many = [(0, c, Chunk(ChunkKey("m", 1, 0, "", bytes(16)), c * size, size, None))
            for c in range(2 * COPY_RUN_BYTES // size + 1)]
    per_run = COPY_RUN_BYTES // size
    assert copy_runs(many, lambda place: True) == [(0, per_run), (per_run, per_run),
                                                    (2 * per_run, 1)]
    assert per_chunk([(0, 2), (2, 1)], ["a", None]) == ["a", "a", None]


def test_host_rows_refuse_what_rows_cannot_copy():
    layers, _ = _mha_layers(2, 8, (0, 1, 2, 3, 4))
    assert HostRows.of([layers[0], layers[1][:, :, :, :, :4]], None, 1) is None  # two layouts
    # a head_dim of 2 float16s (4-byte runs) under vLLM's CPU order: rows too small to pay
    small, _ = _mha_layers(2, 8, (1, 3, 2, 0, 4), head_dim=2)
    assert HostRows.of(small, None, 1) is None
