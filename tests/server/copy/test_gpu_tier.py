"""The GPU tier (--gpu-size) on the CPU: placement, demotion under pressure, quotas over both tiers.

The same stand-ins as test_streams.py (a FakeDevice, "IPC allocations" in CPU memory), and
a GPU tier that is a CPU buffer on that fake device; the store, dispatcher and copier are
the server's own.
"""

from __future__ import annotations

import asyncio

import torch

from lmcache_mp.protocol import (
    LookupItem,
    LookupRequest,
    RetrieveRequest,
    StatsRequest,
    StoreRequest,
    StoreStatus,
    TransferItem,
)
from lmcache_mp.server.cache.chunk import CPU_TIER, GPU_TIER
from lmcache_mp.server.cache.quotas import Quota
from lmcache_mp.server.cache.store import ChunkStore
from lmcache_mp.server.copy.streams import StreamCopier

from ...workers import prompt
from .test_gpu_ordering import GpuRig
from .test_streams import CLIENT, PER_CHUNK, Rig, answered, blocks, until

CHUNK_BYTES = 3 * 2 * PER_CHUNK * 16 * 2 * 8 * 2  # the Rig's MHA cache: 48 KiB per chunk


def transfer(rig: Rig, request: StoreRequest | RetrieveRequest):
    """Send STORE or RETRIEVE through the dispatcher; the device finishes whatever is queued."""
    async def run():
        op = "STORE" if isinstance(request, StoreRequest) else "RETRIEVE"
        task = asyncio.ensure_future(rig.dispatcher.handle(CLIENT, op, request))
        while not task.done():
            rig.device.release()
            await asyncio.sleep(0.001)
        return await task
    return asyncio.run(run())


def store(rig: Rig, instance_id: int, hashes: list[bytes], first_block: int, salt: str = ""):
    ids = list(range(first_block, first_block + len(hashes) * PER_CHUNK))
    return transfer(rig, StoreRequest(instance_id, [TransferItem.build("w", hashes, ids, salt)]))


def tiers(rig: Rig, hashes: list[bytes], salt: str = "") -> list[int | None]:
    chunks = {chunk.key.chunk_hash: chunk for chunk in rig.store._chunks.values()
              if chunk.key.cache_salt == salt}
    return [chunks[h].tier if h in chunks else None for h in hashes]


def test_chunks_fill_the_gpu_tier_then_the_oldest_moves_to_the_cpu_pool():
    rig = Rig(gpu_bytes=2 * CHUNK_BYTES)
    instance_id, source = rig.register("mha", 1, seed=8)
    first, second = prompt(10, 2), prompt(11, 1)
    assert store(rig, instance_id, first, 0).results == [bytes([StoreStatus.STORED] * 2)]
    assert tiers(rig, first) == [GPU_TIER, GPU_TIER]
    assert rig.gpu_pool is not None
    assert rig.gpu_pool.allocator.used == 2 * CHUNK_BYTES and rig.pool.allocator.used == 0

    async def demote():
        # The tier is full: the least recently used GPU chunk (the request's later one,
        # committed first) moves out to make room, and is invisible until its bytes have.
        before = len(rig.device.events)
        task = asyncio.ensure_future(rig.dispatcher.handle(CLIENT, "STORE", StoreRequest(
            instance_id, [TransferItem.build("w2", second, list(range(32, 48)))])))
        # One chunk: an event after its gather and after its DMA, then each stream's last.
        await until(lambda: len(rig.device.events) == before + 2 + 2)
        assert tiers(rig, first) == [GPU_TIER, CPU_TIER]
        assert rig.hits(first) == 1 and rig.store.num_chunks == 2
        rig.store.check_invariants()
        rig.device.release()
        return await asyncio.wait_for(task, 5)
    assert asyncio.run(demote()).results == [bytes([StoreStatus.STORED])]
    assert rig.hits(first) == 2 and rig.hits(second) == 1
    assert tiers(rig, second) == [GPU_TIER]
    assert rig.gpu_pool.allocator.used == 2 * CHUNK_BYTES
    assert rig.pool.allocator.used == CHUNK_BYTES
    rig.store.check_invariants()

    # Both tiers read back byte for byte (the GPU tier's chunk and the demoted one).
    target_id, target = rig.register("mha", 2, seed=None)
    reply = transfer(rig, RetrieveRequest(target_id, [TransferItem.build(
        "r", first + second, list(range(48)))]))
    assert reply.retrieved == [3]
    assert torch.equal(blocks(target, list(range(48)), 1), blocks(source, list(range(48)), 1))
    stats = answered(rig.dispatcher.handle(CLIENT, "STATS", StatsRequest()))
    assert (stats.capacity_bytes, stats.gpu_capacity_bytes) == (
        rig.pool.capacity + 2 * CHUNK_BYTES, 2 * CHUNK_BYTES)
    assert (stats.bytes_used, stats.gpu_bytes_used) == (3 * CHUNK_BYTES, 2 * CHUNK_BYTES)


def test_with_no_room_in_the_cpu_pool_the_gpu_chunk_is_evicted_instead():
    rig = Rig(cpu_bytes=CHUNK_BYTES, gpu_bytes=CHUNK_BYTES)
    instance_id, _ = rig.register("mha", 1, seed=8)
    a, b, c = prompt(20, 1), prompt(21, 1), prompt(22, 1)
    store(rig, instance_id, a, 0)
    store(rig, instance_id, b, 16)  # a moves to the CPU pool, b takes the GPU tier
    assert tiers(rig, a + b) == [CPU_TIER, GPU_TIER]
    # A lease holds a in the CPU pool: b cannot move there, so it is evicted for c.
    rig.dispatcher.handle(CLIENT, "LOOKUP", LookupRequest("m", 1, [
        LookupItem.build("keep", a, hold=True)]))
    assert store(rig, instance_id, c, 32).results == [bytes([StoreStatus.STORED])]
    assert tiers(rig, a + b + c) == [CPU_TIER, None, GPU_TIER]
    assert rig.store.total("evictions") == 1
    rig.store.check_invariants()


def test_quotas_count_both_tiers():
    rig = Rig(gpu_bytes=2 * CHUNK_BYTES)
    rig.store.quotas.set("t", Quota(cap=3 * CHUNK_BYTES))
    instance_id, _ = rig.register("mha", 1, seed=8)
    hashes = prompt(30, 4)
    for i, chunk_hash in enumerate(hashes[:3]):
        store(rig, instance_id, [chunk_hash], 16 * i, salt="t")
    assert sorted(tier for tier in tiers(rig, hashes[:3], "t") if tier is not None) == [
        CPU_TIER, GPU_TIER, GPU_TIER]
    assert rig.store.tenants["t"].bytes_used == 3 * CHUNK_BYTES
    # The cap covers both tiers: a fourth chunk evicts the salt's least recent one.
    assert store(rig, instance_id, hashes[3:], 48, salt="t").results == [
        bytes([StoreStatus.STORED])]
    assert rig.store.tenants["t"].bytes_used == 3 * CHUNK_BYTES
    assert tiers(rig, hashes, "t").count(None) == 1
    rig.store.check_invariants()


def test_the_thread_pool_path_reads_chunks_from_the_gpu_tier():
    rig = Rig(gpu_bytes=2 * CHUNK_BYTES)
    instance_id, source = rig.register("mha", 1, seed=9)
    hashes = prompt(40, 1)
    store(rig, instance_id, hashes, 16)
    assert tiers(rig, hashes) == [GPU_TIER]
    # A registration without a lane copies on the thread pool, as shm caches do; its chunk
    # source is a view of the GPU tier.
    target_id, target = rig.register("mha", 2, seed=None)
    (instance,) = [i for i in rig.registry.instances() if i.instance_id == target_id]
    instance.lane = None
    reply = transfer(rig, RetrieveRequest(target_id, [TransferItem.build(
        "r", hashes, list(range(16)))]))
    assert reply.retrieved == [1]
    assert torch.equal(blocks(target, list(range(16)), 1), blocks(source, list(range(16, 32)), 1))


class Forgetful(StreamCopier):
    """Queues a STORE's chunks but not the demotions' copies out of the GPU tier."""

    async def store(self, instance, jobs, moves=(), deadline=None):
        errors = await super().store(instance, jobs, (), deadline)
        return [None] * len(moves) + errors


def _tier_under_pressure(copier: type = StreamCopier) -> dict:
    """tests/gpu's tier test, on the CPU: a GPU tier and a pool of two chunks each; prompt
    A of two chunks, then B, C and D of one. Each of B, C, D takes the GPU bytes of the least
    recently used leaf there, which moves to the pool: A's second chunk, then B, then C,
    which pushes A's second chunk out of the full pool. What the client would see, and the
    copies out of the GPU tier that the device ran."""
    rig = GpuRig(copier=copier, cpu_bytes=2 * CHUNK_BYTES, gpu_bytes=2 * CHUNK_BYTES)
    instance_id, source = rig.register_on(0, "mha", 1, seed=8)
    prompts = [prompt(60, 2), prompt(61, 1), prompt(62, 1), prompt(63, 1)]
    for hashes, first in zip(prompts, (0, 32, 48, 0)):
        rig.run(StoreRequest(instance_id, [TransferItem.build(
            "w", hashes, list(range(first, first + PER_CHUNK * len(hashes))))]))
    log = rig.device.log
    demotions = sum(1 for a, b in zip(log, log[1:])
                    if a.region == "gpu tier" and not a.writes and b.region == "pool"
                    and b.writes and (a.stream, a.tick) == (b.stream, b.tick))
    target_id, target = rig.register_on(0, "mha", 2, seed=None)
    retrieved = rig.run(RetrieveRequest(target_id, [
        TransferItem.build("b", prompts[1], list(range(16))),
        TransferItem.build("c", prompts[2], list(range(16, 32)))])).retrieved
    stats = answered(rig.dispatcher.handle(CLIENT, "STATS", StatsRequest()))
    found = {
        "hits": [rig.hits(hashes) for hashes in prompts], "evictions": stats.evictions,
        "gpu bytes": stats.gpu_bytes_used, "cpu bytes": stats.bytes_used - stats.gpu_bytes_used,
        "retrieved": retrieved, "demotion copies": demotions, "races": rig.device.races(),
        "demoted bytes intact": torch.equal(blocks(target, list(range(32)), 1),
                                            blocks(source, list(range(32, 64)), 1))}
    rig.close()
    return found


DEMOTING = {"hits": [1, 1, 1, 1], "evictions": 1, "gpu bytes": 2 * CHUNK_BYTES,
            "cpu bytes": 2 * CHUNK_BYTES, "retrieved": [1, 1], "demotion copies": 3,
            "races": [], "demoted bytes intact": True}


def test_a_leaf_in_a_full_gpu_tier_is_demoted_by_a_copy_the_device_runs():
    assert _tier_under_pressure() == DEMOTING


def test_the_tier_check_catches_a_store_that_never_demotes_or_never_copies(monkeypatch):
    forgetful = _tier_under_pressure(Forgetful)
    assert forgetful["demotion copies"] == 0 and not forgetful["demoted bytes intact"]
    monkeypatch.setattr(ChunkStore, "_allocate_gpu",
                        lambda self, size: (self.allocators[GPU_TIER].allocate(size), None))
    never = _tier_under_pressure()
    assert never["hits"] == [2, 0, 1, 1] and never["demotion copies"] == 0
