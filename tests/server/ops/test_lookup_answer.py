"""A LOOKUP's holds follow its reply (off the round trip), yet come before anything else the
server reads: a cap lowered in the same wake as the LOOKUP evicts none of its chunks."""

import signal

import torch

from lmcache_mp.client import CacheClient, LookupItem, StoreStatus, TransferItem
from lmcache_mp.protocol import LookupRequest, QuotaSetRequest

from ...utils import run_server, started_process, stop_process
from ...workers import BLOCKS_PER_CHUNK, MODEL, chunk_blocks, make_cache, prompt

CHUNKS = 8
CHUNK_BYTES = 512 * 1024  # W2


def test_a_cap_lowered_right_after_a_held_lookup_evicts_none_of_its_chunks():
    with make_cache(CHUNKS * BLOCKS_PER_CHUNK, 7) as cache, run_server() as server, \
            CacheClient(server.url, admin=True) as client:
        registration = client.register_kv_cache(cache.handles(), model=MODEL, layout="mha",
                                                block_size=16)
        slots = chunk_blocks(range(CHUNKS))
        held, other = prompt(1, CHUNKS), prompt(2, CHUNKS)
        for hashes in (held, other):
            assert list(client.store(registration, [TransferItem.build("w", hashes, slots)])[0]
                        ) == [StoreStatus.STORED] * CHUNKS
        stored = cache.blocks(slots).view(torch.uint8).clone()

        # The server stopped, both requests wait in its socket and are read in one go. The
        # cap is set at once, as the LOOKUP is answered, and evicts the least recent chunks
        # not held: the held prompt was stored first.
        stop_process(started_process(server).pid)
        lookup = client.rpc.submit(LookupRequest(MODEL, 1, [
            LookupItem.build("r", held, "", hold=True)]))
        quota = client.rpc.submit(QuotaSetRequest("", CHUNKS * CHUNK_BYTES))
        started_process(server).send_signal(signal.SIGCONT)
        assert lookup.result(timeout=60).hits == [CHUNKS]
        quota.result(timeout=60)
        assert client.stats().bytes_used == CHUNKS * CHUNK_BYTES

        cache.blocks(slots).view(torch.uint8).zero_()
        assert client.retrieve(registration, [TransferItem.build("r", held, slots)]) == [CHUNKS]
        assert torch.equal(cache.blocks(slots).view(torch.uint8), stored)
        assert client.lookup(MODEL, 1, [LookupItem.build("q", other, "")]) == [0]
