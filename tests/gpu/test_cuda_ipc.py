"""On a GPU: KV caches registered by CUDA IPC with a real server, copied byte for byte.

This process is the worker (its caches live on cuda:0); the server is a subprocess that
maps them through cuda_ipc handles and copies with its own streams. The tests share one
server (module-scoped: a CUDA server takes seconds to start), except the GPU tier's,
which needs its own flags and an empty pool.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import secrets
import time

import pytest
import torch

from lmcache_mp.client import CacheClient, LookupItem, StoreStatus, TransferItem
from lmcache_mp.client.cuda import StoreEvent, cuda_ipc_handles
from lmcache_mp.cuda import address_range, device_uuid

from ..utils import run_server
from ..workers import CHUNK_SIZE, MODEL, prompt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                       reason="needs a CUDA GPU and cupy"),
]

BLOCK = 16
PER_CHUNK = CHUNK_SIZE // BLOCK
NUM_BLOCKS = 8 * PER_CHUNK


@pytest.fixture(scope="module")
def server():
    """One server for the module's tests; it must exit 0 when the module is done."""
    with run_server() as shared:
        yield shared


def random_layers(num_layers: int, shape: list[int], dtype: torch.dtype, seed: int | None,
                  one_allocation: bool) -> list[torch.Tensor]:
    """Layers on cuda:0, each its own allocation or all inside one (at an offset)."""
    numel = torch.Size(shape).numel()
    if one_allocation:
        whole = torch.empty(4096 + num_layers * numel * dtype.itemsize, dtype=torch.uint8,
                            device="cuda:0")
        typed = whole[4096:].view(dtype)
        layers = [typed[i * numel:(i + 1) * numel].view(shape) for i in range(num_layers)]
    else:
        layers = [torch.empty(shape, dtype=dtype, device="cuda:0") for _ in range(num_layers)]
    generator = torch.Generator(device="cuda:0")
    for layer in layers:
        raw = layer.view(torch.uint8)
        if seed is None:
            raw.zero_()
        else:
            generator.manual_seed(seed)
            seed += 1
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device="cuda:0",
                                    generator=generator))
    return layers


def chunk_ids(slots: list[int]) -> list[int]:
    return [slot * PER_CHUNK + b for slot in slots for b in range(PER_CHUNK)]


def blocks(layers: list[torch.Tensor], ids: list[int], dim: int) -> torch.Tensor:
    index = torch.tensor(ids, device="cuda:0")
    return torch.stack([layer.index_select(dim, index) for layer in layers]).view(torch.uint8)


def test_handles_name_the_allocation_and_the_offset():
    layers = random_layers(3, [2, 64, BLOCK, 2, 64], torch.float16, None, one_allocation=True)
    handles = cuda_ipc_handles(layers)
    with torch.cuda.device(0):
        base, size = address_range(layers[0].data_ptr())
    assert len({h.ipc_handle for h in handles}) == 1 and len(handles[0].ipc_handle) == 64
    assert [h.offset for h in handles] == [t.data_ptr() - base for t in layers]
    assert handles[0].offset >= 4096 and handles[-1].offset + layers[-1].numel() * 2 <= size
    assert handles[0].device_uuid == device_uuid(0)


@pytest.mark.parametrize("one_allocation", [False, True], ids=["per-layer", "one-allocation"])
def test_store_and_retrieve_through_cuda_ipc_byte_for_byte(server, one_allocation):
    shape = [2, NUM_BLOCKS, BLOCK, 2, 64]
    source = random_layers(4, shape, torch.float16, 7, one_allocation)
    target = random_layers(4, shape, torch.float16, None, one_allocation)
    event = StoreEvent(source[0].device)
    hashes = prompt(600 + one_allocation, 3)
    with CacheClient(server.url, timeout=60) as client:
        registered = client.stats().registrations  # other tests' on the shared server
        mine = client.register_kv_cache(cuda_ipc_handles(source), model=MODEL, layout="mha",
                                        block_size=BLOCK, store_event=event.handle)
        theirs = client.register_kv_cache(cuda_ipc_handles(target), model=MODEL, layout="mha",
                                          block_size=BLOCK)
        source_ids = chunk_ids([5, 0, 3])
        event.record()
        assert client.store(mine, [TransferItem.build("w", hashes, source_ids)]) == [
            bytes([StoreStatus.STORED] * 3)]
        assert client.lookup(MODEL, 1, [LookupItem.build("r", hashes, hold=True)]) == [3]
        target_ids = chunk_ids([1, 2, 7])
        target_ids[4] = -1  # SKIP_BLOCK: the engine holds it already
        assert client.retrieve(theirs, [TransferItem.build("r", hashes, target_ids)]) == [3]
        written = [i for i, b in enumerate(target_ids) if b >= 0]
        assert torch.equal(blocks(target, [target_ids[i] for i in written], 1),
                           blocks(source, [source_ids[i] for i in written], 1))
        assert bool((blocks(target, [chunk_ids([1])[4]], 1) == 0).all())
        untouched = sorted(set(range(NUM_BLOCKS)) - set(target_ids))
        assert bool((blocks(target, untouched, 1) == 0).all())
        client.unregister(mine)
        client.unregister(theirs)
        # A worker that restarts (or re-registers) maps the same memory again.
        again = client.register_kv_cache(cuda_ipc_handles(source), model=MODEL, layout="mha",
                                         block_size=BLOCK, store_event=event.handle)
        assert client.stats().registrations == registered + 1
        client.unregister(again)


def test_an_mla_leader_fills_its_follower_on_the_gpu(server):
    shape = [NUM_BLOCKS, BLOCK, 576]
    leader = random_layers(2, shape, torch.bfloat16, 11, one_allocation=False)
    follower = random_layers(2, shape, torch.bfloat16, None, one_allocation=False)
    hashes = prompt(700, 2)
    engine = secrets.token_hex(16)  # one engine: an MLA group has ranks of one engine only
    with CacheClient(server.url, timeout=60, engine=engine) as lead, \
            CacheClient(server.url, timeout=60, mla_follower=True, engine=engine) as follow:
        event = StoreEvent(leader[0].device)
        mine = lead.register_kv_cache(cuda_ipc_handles(leader), model=MODEL, layout="mla",
                                      block_size=BLOCK, tp_rank=0, store_event=event.handle)
        follow.register_kv_cache(cuda_ipc_handles(follower), model=MODEL, layout="mla",
                                 block_size=BLOCK, tp_rank=1)
        event.record()
        lead.store(mine, [TransferItem.build("w", hashes, chunk_ids([0, 1]))])
        assert lead.retrieve(mine, [TransferItem.build("g", hashes, chunk_ids([4, 6]))]) == [2]
        assert follow.wait_for_load("g", timeout=30) == 2
        expected = blocks(leader, chunk_ids([0, 1]), 0)
        assert torch.equal(blocks(leader, chunk_ids([4, 6]), 0), expected)
        assert torch.equal(blocks(follower, chunk_ids([4, 6]), 0), expected)


def test_a_gpu_tier_demotes_its_least_recent_leaf_under_pressure():
    """A GPU tier and a CPU pool of two chunks each (tests/server/copy/test_gpu_tier.py runs the
    same on the CPU and counts the copies): prompt A of two chunks, then B, C and D of one.
    Each takes the GPU bytes of the least recently used leaf there, which is copied to the
    pool: A's second chunk, then B, then C, which pushes A's second chunk out of the full
    pool. A server that never demoted would keep all of A and lose B instead; one that
    demoted without the copy would read B and C back wrong."""
    shape = [2, NUM_BLOCKS, BLOCK, 2, 64]
    source = random_layers(4, shape, torch.float16, 21, one_allocation=False)
    target = random_layers(4, shape, torch.float16, None, one_allocation=False)
    event = StoreEvent(source[0].device)
    prompts = [prompt(800, 2), prompt(801, 1), prompt(802, 1), prompt(803, 1)]
    with run_server("--gpu-size", "1MiB", "--cpu-size", "1MiB") as server, \
            CacheClient(server.url, timeout=60) as client:
        mine = client.register_kv_cache(cuda_ipc_handles(source), model=MODEL, layout="mha",
                                        block_size=BLOCK, store_event=event.handle)
        theirs = client.register_kv_cache(cuda_ipc_handles(target), model=MODEL, layout="mha",
                                          block_size=BLOCK)
        assert mine.chunk_bytes == 512 * 1024  # each tier holds two chunks
        event.record()
        for hashes, slots in zip(prompts, ([0, 1], [2], [3], [4])):
            assert client.store(mine, [TransferItem.build("w", hashes, chunk_ids(slots))]) == [
                bytes([StoreStatus.STORED] * len(hashes))]
        assert [client.lookup(MODEL, 1, [LookupItem.build("q", hashes)])[0]
                for hashes in prompts] == [1, 1, 1, 1]
        stats = client.stats()
        assert stats.evictions == 1
        assert (stats.gpu_bytes_used, stats.bytes_used) == (2 * mine.chunk_bytes,
                                                            4 * mine.chunk_bytes)
        # B and C were demoted: their bytes reached the pool by the demotion's copy.
        assert client.retrieve(theirs, [TransferItem.build("b", prompts[1], chunk_ids([5])),
                                        TransferItem.build("c", prompts[2], chunk_ids([6]))]
                               ) == [1, 1]
        assert torch.equal(blocks(target, chunk_ids([5, 6]), 1),
                           blocks(source, chunk_ids([2, 3]), 1))


# About a second of a GPU's clock: the server would long have copied the blocks by then.
_SLEEP_CYCLES = 2_000_000_000


@pytest.mark.parametrize("use_event", [True, False], ids=["event", "no-event-control"])
def test_a_store_waits_for_blocks_still_being_written(server, use_event):
    """The worker's stream sleeps, then writes the blocks and records the store event, and
    STORE goes out at once. With the event the server reads the new bytes; the control
    registers none, and must read the old ones: else this test could not fail."""
    shape = [2, NUM_BLOCKS, BLOCK, 2, 64]
    layers = random_layers(2, shape, torch.float16, None, one_allocation=False)
    fresh = random_layers(2, shape, torch.float16, 31, one_allocation=False)
    target = random_layers(2, shape, torch.float16, None, one_allocation=False)
    event = StoreEvent(layers[0].device)
    hashes = prompt(900 + use_event, 1)
    stream = torch.cuda.Stream(device=layers[0].device)
    with CacheClient(server.url, timeout=60) as client:
        mine = client.register_kv_cache(cuda_ipc_handles(layers), model=MODEL, layout="mha",
                                        block_size=BLOCK,
                                        store_event=event.handle if use_event else b"")
        theirs = client.register_kv_cache(cuda_ipc_handles(target), model=MODEL, layout="mha",
                                          block_size=BLOCK)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(_SLEEP_CYCLES)
            for layer, new in zip(layers, fresh):
                layer.copy_(new)
            event.record()
        client.store(mine, [TransferItem.build("w", hashes, chunk_ids([0]))])
        assert client.retrieve(theirs, [TransferItem.build("r", hashes, chunk_ids([1]))]) == [1]
        stream.synchronize()
        read = blocks(target, chunk_ids([1]), 1)
        assert torch.equal(read, blocks(fresh, chunk_ids([0]), 1)) == use_event
        client.unregister(mine)
        client.unregister(theirs)


def _registered_worker(url: str, conn) -> None:
    """A GPU worker that registers its cache by CUDA IPC, says so, and waits to be killed."""
    layers = random_layers(2, [2, NUM_BLOCKS, BLOCK, 2, 64], torch.float16, 3,
                           one_allocation=False)
    client = CacheClient(url, timeout=60)
    client.register_kv_cache(cuda_ipc_handles(layers), model=MODEL, layout="mha",
                             block_size=BLOCK)
    conn.send("registered")
    conn.recv()


def test_a_killed_gpu_worker_is_unregistered_at_once(server):
    context = multiprocessing.get_context("spawn")  # never fork a process that used CUDA
    conn, child = context.Pipe()
    worker = context.Process(target=_registered_worker, args=(server.url, child), daemon=True)
    with CacheClient(server.url, timeout=60) as client:
        registered = client.stats().registrations
        worker.start()
        try:
            assert conn.poll(50) and conn.recv() == "registered"
            assert client.stats().registrations == registered + 1
        finally:
            worker.kill()
            worker.join()
        killed = time.monotonic()
        # The server closes the IPC allocation when the watch hangs up, not at its
        # --worker-timeout (30 s by default).
        while client.stats().registrations != registered:
            assert time.monotonic() - killed < 10, "the dead worker's registration stayed"
            time.sleep(0.05)
