import os

import pytest
import torch

from lmcache_mp.client import SharedKVCache
from lmcache_mp.client.shm import shm_handles


def test_layers_live_back_to_back_in_one_segment_described_by_handles():
    with SharedKVCache("mha", 3, 10, 16, 2, 8, torch.bfloat16) as cache:
        assert os.path.exists(f"/dev/shm/{cache.name}")
        handles = cache.handles()
        layer_bytes = 2 * 10 * 16 * 2 * 8 * 2
        assert [h.offset for h in handles] == [0, layer_bytes, 2 * layer_bytes]
        assert all(h.shape == [2, 10, 16, 2, 8] and h.dtype == "bfloat16" for h in handles)
        assert handles[0].strides == list(cache.layers[0].stride())
        cache.layers[1][0, 3].fill_(1.5)
        assert cache.blocks([3]).shape == (3, 2, 1, 16, 2, 8)
        assert float(cache.blocks([3])[1, 0].sum()) == 1.5 * 16 * 2 * 8
    assert not os.path.exists(f"/dev/shm/{cache.name}")
    cache.close()  # a second close is harmless


def test_mla_layout():
    with SharedKVCache("mla", 2, 4, 16, 1, 576, torch.bfloat16) as cache:
        assert cache.layers[0].shape == (4, 16, 576)
        assert cache.blocks([0, 2]).shape == (2, 2, 16, 576)
    with pytest.raises(ValueError, match="heads must be 1"):
        SharedKVCache("mla", 2, 4, 16, 2, 576)
    with pytest.raises(ValueError, match="layout"):
        SharedKVCache("gqa", 2, 4, 16, 2, 64)


def test_shm_handles_find_the_segment_of_any_view_and_refuse_private_memory():
    with SharedKVCache("mha", 2, 8, 16, 2, 8) as cache:
        view = cache.layers[1][:, 2:5]
        (handle,) = shm_handles([view])
        assert handle.name == cache.name
        assert handle.offset == cache.handles()[1].offset + view.storage_offset() * 2 - (
            cache.layers[1].storage_offset() * 2)
        assert handle.shape == list(view.shape) and handle.strides == list(view.stride())
        with pytest.raises(ValueError, match="tensor 1 .* is not in shared memory"):
            shm_handles([view, torch.zeros(4)])
