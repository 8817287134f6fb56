"""Loads read layer by layer: a RETRIEVE with a progress_tag into a cache in CPU memory is
written one layer at a time, and each LOAD_PROGRESS it sends says truly that the first
layers' blocks hold their bytes."""

import torch

from lmcache_mp.client import CacheClient, ParallelStrategy, TransferItem, WorkerAdapter

from ..utils import run_server
from ..workers import MODEL, W2, chunk_blocks, make_cache, prompt

NUM_BLOCKS = 16 * 16
ALONE = ParallelStrategy(False, 1, 0, 1)


def blocks(cache, layer: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    return layer.index_select(cache.block_dim(), torch.tensor(block_ids)).view(torch.uint8)


def stored(client: CacheClient, cache, hashes, source) -> WorkerAdapter:
    adapter = WorkerAdapter(client, MODEL, ALONE, load_timeout=30)
    adapter.register_kv_cache(cache)
    adapter.start_store([TransferItem.build("w", hashes, source)])
    adapter.wait_for_stores(["w"])
    assert adapter.get_finished()[0] == {"w"}
    return adapter


def test_each_layer_holds_its_bytes_once_it_has_settled():
    """wait_for_layer(l) returns once layer l (and those before it) settled: its blocks
    hold the stored bytes then, whatever the later layers hold; the load reports no error."""
    hashes = prompt(410, 6)
    source, target = chunk_blocks([0, 1, 2, 3, 4, 5]), chunk_blocks([8, 9, 10, 11, 12, 13])
    with run_server() as server, make_cache(NUM_BLOCKS, 7) as cache, \
            CacheClient(server.url, timeout=30) as client:
        adapter = stored(client, cache, hashes, source)
        adapter.start_load([TransferItem.build("r", hashes, target)], by_layer=True)
        for layer, tensor in enumerate(cache.layers):
            adapter.wait_for_layer(["r"], layer)
            assert torch.equal(blocks(cache, tensor, target), blocks(cache, tensor, source)), layer
        adapter.wait_for_loads(["r"])
        assert adapter.get_finished()[1] == {"r"}
        assert adapter.get_block_ids_with_load_errors() == set()


def test_the_server_says_every_layer_but_the_last_before_its_reply():
    """The protocol: LOAD_PROGRESS for 1 .. layers-1 layers, in order, all before the reply
    (the reply settles the last); none without a progress_tag."""
    hashes = prompt(411, 4)
    source, target = chunk_blocks([0, 1, 2, 3]), chunk_blocks([6, 7, 8, 9])
    with run_server() as server, make_cache(NUM_BLOCKS, 8) as cache, \
            CacheClient(server.url, timeout=30) as client:
        registration = stored(client, cache, hashes, source).registration
        assert registration is not None
        seen: list[int] = []
        receive = client._on_push

        def on_push(payload: bytes) -> None:  # what the reading thread hands the client
            receive(payload)
            seen.append(client.layers_settled(77))
        client.rpc.on_push = on_push
        reply = client.retrieve_async(registration, [TransferItem.build("r", hashes, target)],
                                      30, progress_tag=77)
        client.wait([reply], 30)
        assert reply.result().retrieved == [4]
        assert seen == list(range(1, W2["num_layers"]))
        assert client.layers_settled(77) == W2["num_layers"] - 1
        client.forget_progress(77)
        assert client.layers_settled(77) == 0
        for layer in cache.layers:
            assert torch.equal(blocks(cache, layer, target), blocks(cache, layer, source))

        plain = client.retrieve_async(registration, [TransferItem.build("r", hashes, target)],
                                      30)
        client.wait([plain], 30)
        assert plain.result().retrieved == [4]
        assert seen == list(range(1, W2["num_layers"]))  # no push for a RETRIEVE without a tag
