"""The "state" layout (a recurrent layer's state, one block per chunk) against a real server:
its registration is checked like every geometry, its chunks are stored, pushed to the disk
tier and retrieved byte for byte like any chunk, counted in the salt's usage."""

from __future__ import annotations

import pytest
import torch

from lmcache_mp.client import CacheClient, LookupItem, StoreStatus, TransferItem
from lmcache_mp.client.memfd import SharedSegment
from lmcache_mp.errors import BadRequest
from lmcache_mp.protocol import SKIP_BLOCK, MemfdHandle

from ...utils import run_server, wait_for
from ...workers import CHUNK_SIZE, prompt

LAYERS = 2
STATE_BYTES = 96 * 1024  # one layer's state: 192 KiB a chunk over both layers
NUM_BLOCKS = 40


class StateCache:
    """vLLM's recurrent layers as it hands them: per layer, [blocks, state bytes] of int8,
    here in one SharedSegment, filled with random bytes from `seed`."""

    def __init__(self, seed: int):
        self.segment = SharedSegment(LAYERS * NUM_BLOCKS * STATE_BYTES)
        self.layers = self.segment.tensor(torch.int8).view(LAYERS, NUM_BLOCKS, STATE_BYTES)
        generator = torch.Generator().manual_seed(seed)
        self.layers.copy_(torch.randint(-128, 128, self.layers.shape, dtype=torch.int8,
                                        generator=generator))

    def handles(self, shape=(NUM_BLOCKS, STATE_BYTES)) -> list[MemfdHandle]:
        return [MemfdHandle(ticket=b"", offset=layer * NUM_BLOCKS * STATE_BYTES,
                            shape=list(shape), strides=[STATE_BYTES, 1][:len(shape)],
                            dtype="int8", name=self.segment.name) for layer in range(LAYERS)]

    def register(self, client: CacheClient, block_size: int = CHUNK_SIZE):
        return client.register_kv_cache(self.handles(), model="hybrid", layout="state",
                                        block_size=block_size)

    def close(self) -> None:
        del self.layers  # the segment's memory goes with the last view of it
        self.segment.close()


def stats(server):
    with CacheClient(server.url, timeout=10, admin=True, token=server.token(admin=True)) as c:
        return c.stats()


def test_a_state_registration_is_checked_and_its_chunks_are_one_state_each():
    with run_server() as server, CacheClient(server.url) as client:
        cache = StateCache(seed=1)
        try:
            with pytest.raises(BadRequest, match="its block_size is the chunk size 256, got 16"):
                cache.register(client, 16)
            with pytest.raises(BadRequest, match="layout 'state' needs 2 dimensions"):
                client.register_kv_cache(cache.handles((NUM_BLOCKS, 1, STATE_BYTES)),
                                         model="hybrid", layout="state", block_size=CHUNK_SIZE)
            registration = cache.register(client)
            assert (registration.num_blocks, registration.blocks_per_chunk,
                    registration.chunk_bytes) == (NUM_BLOCKS, 1, LAYERS * STATE_BYTES)
            hashes = prompt(61, 3)
            # one block id per chunk: the state at each chunk's end
            assert client.store(registration, [TransferItem.build("w", hashes, [5, 6, 7])]) \
                == [bytes([StoreStatus.STORED] * 3)]
            with pytest.raises(BadRequest, match=r"3 chunks need 3 block ids \(1 per chunk\)"):
                client.store(registration, [TransferItem.build("w", hashes, [5] * 16 * 3)])
        finally:
            cache.close()
        assert client.ping() > 0


def test_state_chunks_go_to_disk_and_come_back_byte_for_byte_counted_in_the_salt(tmp_path):
    """A pool of 4 MiB holds 21 state chunks of 192 KiB; 36 are stored: the disk tier holds
    the rest, and a load of the state at the end of each prompt writes that block alone."""
    salt = "recurrent"
    prompts = [prompt(70 + i, 6) for i in range(6)]
    with run_server("--cpu-size", "4MiB", "--disk-dir", str(tmp_path / "disk"),
                    "--disk-size", "64MiB", "--disk-prefetch-wait", "30") as server, \
            CacheClient(server.url) as client:
        writer, reader = StateCache(seed=2), StateCache(seed=3)
        try:
            stored = writer.register(client)
            for i, hashes in enumerate(prompts):
                assert client.store(stored, [TransferItem.build(
                    f"w{i}", hashes, list(range(6 * i % 36, 6 * i % 36 + 6)),
                    cache_salt=salt)]) == [bytes([StoreStatus.STORED] * 6)]
                wait_for(lambda: stats(server).disk_queue_chunks == 0, "the disk queue")
            tenant = stats(server).tenants[salt]
            # the pool keeps the last 21 (a state chunk's bytes, counted as any chunk's), the
            # disk tier all 36
            assert (tenant.chunks, tenant.bytes_used, tenant.disk_chunks) == (
                21, 21 * LAYERS * STATE_BYTES, 36)
            loaded = reader.register(client)
            for i, hashes in enumerate(prompts):
                assert client.lookup("hybrid", 1, [LookupItem.build(f"r{i}", hashes, salt)],
                                     timeout=30) == [6]
                target = 39 - i  # the state at the prompt's end, into a block of its own
                client.retrieve(loaded, [TransferItem.build(
                    f"r{i}", hashes, [SKIP_BLOCK] * 5 + [target], cache_salt=salt)])
                assert torch.equal(reader.layers[:, target], writer.layers[:, 6 * i + 5])
            untouched = StateCache(seed=3)
            assert torch.equal(reader.layers[:, :34], untouched.layers[:, :34])
            untouched.close()
            assert stats(server).leases_held == 0
        finally:
            writer.close()
            reader.close()
