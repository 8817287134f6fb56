"""The GPU copy path on the CPU: cuda_ipc registration and the stream/event state machine.

The server's own registry, chunk store, pool, dispatcher and StreamCopier run here with
two stand-ins at the device layer only: a FakeDevice whose events complete when the test
says so, and "IPC allocations" that are CPU buffers. Everything above them is the code a
GPU server runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lmcache_mp.cuda import normalize_uuid
from lmcache_mp.errors import BadRequest, InternalError
from lmcache_mp.protocol import (
    SKIP_BLOCK,
    CudaIpcHandle,
    LoadDone,
    LookupItem,
    LookupRequest,
    MemfdHandle,
    RegisterKVCacheRequest,
    RetrieveRequest,
    StoreRequest,
    StoreStatus,
    TensorHandle,
    TransferItem,
    UnregisterKVCacheRequest,
)
from lmcache_mp.server.cache.pool import CpuPool, DevicePool
from lmcache_mp.server.cache.store import ChunkStore
from lmcache_mp.server.config import Config
from lmcache_mp.server.copy.engine import CopyEngine
from lmcache_mp.server.copy.streams import StreamCopier
from lmcache_mp.server.memory.cuda_ipc import CudaIpcSupport, SharedAllocations
from lmcache_mp.server.memory.geometry import DTYPES
from lmcache_mp.server.memory.registry import Registry
from lmcache_mp.server.net.access import Sessions
from lmcache_mp.server.ops.dispatcher import Dispatcher

from ...utils import NoTickets
from ...workers import prompt

UUID = "58b8f8a1-0c3d-4e5f-8a9b-0123456789ab"
CLIENT = b"worker"
BLOCK, HEADS, HEAD_DIM, LAYERS = 16, 2, 8, 3
BLOCKS = 64  # 4 chunks of 16 blocks
PER_CHUNK = 256 // BLOCK


class FakeEvent:
    def __init__(self, done: bool = False):
        self.done = done
        self.clock: dict[str, int] = {}  # the recording stream's, on an OrderedDevice


class FakeDevice:
    """The Device interface on the CPU: torch work runs at once, events complete on release()."""

    def __init__(self):
        self.events: list[FakeEvent] = []
        self.waits: list[tuple[str, FakeEvent]] = []
        self.opened: list[bytes] = []
        self.streams = 0

    def new_stream(self, device):
        self.streams += 1
        return f"stream-{self.streams}"

    def use(self, stream):
        return contextlib.nullcontext()

    def record(self, stream):
        event = FakeEvent()
        self.events.append(event)
        return event

    def wait(self, stream, event):
        self.waits.append((stream, event))

    def query(self, event):
        return event.done

    def used_on(self, tensor, stream):
        pass

    def open_event(self, device, handle):
        self.opened.append(handle)
        return FakeEvent(done=True)

    def release(self):
        for event in self.events:
            event.done = True


class FakeAllocation:
    def __init__(self, data: torch.Tensor, log: list):
        self.data, self.log = data, log

    def close(self):
        self.log.append(("close", self.data.data_ptr()))


class Rig:
    """A dispatcher over the real store, pool, registry and StreamCopier, on a FakeDevice."""

    def __init__(self, timeout: float = 30.0, cpu_bytes: int = 16 * 1024**2, gpu_bytes: int = 0,
                 device: FakeDevice | None = None, copier: type = StreamCopier):
        """`gpu_bytes`: a GPU tier of that size (in CPU memory, on the fake device)."""
        self.device = device or FakeDevice()
        self.log: list = []
        self.memory: dict[bytes, torch.Tensor] = {}  # "IPC handle" -> the worker's allocation
        self.pool = CpuPool(cpu_bytes)
        self.gpu_pool = DevicePool(gpu_bytes, torch.device("cpu")) if gpu_bytes else None
        self.store = ChunkStore(self.pool.allocator, 60.0, gpu_allocator=self.gpu_pool.allocator
                                if self.gpu_pool is not None else None)
        self.copier = copier(self.device, 1, timeout)
        self.shared = SharedAllocations(self.open_allocation)
        support = CudaIpcSupport(self.shared.open,
                                 lambda uuid: 0 if normalize_uuid(uuid) == UUID else None,
                                 self.copier.new_lane)
        self.registry = Registry(256, time.monotonic, NoTickets(), support)
        self.pushed: list = []
        self.sessions = sessions = Sessions("engine-token-0123456789", "admin-token-0123456789",
                                            token_required=False)
        self.engine = sessions.open(CLIENT, "", "the rig's engine").engine
        self.dispatcher = Dispatcher(Config(cpu_size=16 * 1024**2), self.store, self.pool,
                                     self.registry, CopyEngine(1), sessions, "",
                                     push=lambda client, m: self.pushed.append((client, m)),
                                     copier=self.copier, gpu_pool=self.gpu_pool)

    def open_allocation(self, handle: bytes, index: int) -> FakeAllocation:
        self.log.append(("open", handle))
        return FakeAllocation(self.memory[handle], self.log)

    def allocation(self, tag: int, nbytes: int, seed: int | None) -> bytes:
        """A worker allocation of random (or zero) bytes; its 64-byte 'IPC handle'."""
        handle = bytes([tag]) * 64
        data = torch.zeros(nbytes, dtype=torch.uint8)
        if seed is not None:
            data.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(seed)))
        self.memory[handle] = data
        return handle

    def register(self, layout: str, tag: int, seed: int | None, tp_rank: int = 0,
                 store_event: bytes = b"", dtype: str = "float16", client: bytes = CLIENT
                 ) -> tuple[int, list[torch.Tensor]]:
        """Layers back to back after a 4 KiB gap, so offsets are not 0; returns the views."""
        if layout == "mha":
            shape = [2, BLOCKS, BLOCK, HEADS, HEAD_DIM]
        else:
            shape = [BLOCKS, BLOCK, 64]
        layer = torch.empty(shape, dtype=DTYPES[dtype])
        nbytes = layer.numel() * layer.element_size()
        handle = self.allocation(tag, 4096 + LAYERS * nbytes, seed)
        handles: list[TensorHandle] = [
            CudaIpcHandle(handle, 4096 + i * nbytes, "GPU-" + UUID.upper(), list(shape),
                          list(layer.stride()), dtype)
            for i in range(LAYERS)]
        reply = self.dispatcher.handle(client, "REGISTER_KV_CACHE", RegisterKVCacheRequest(
            "m", 1, 0, layout, BLOCK, handles, tp_rank, "g", store_event))
        typed = self.memory[handle][4096:].view(DTYPES[dtype])
        views = [typed[i * layer.numel():(i + 1) * layer.numel()].view(shape)
                 for i in range(LAYERS)]
        return answered(reply).instance_id, views

    def hits(self, hashes: list[bytes]) -> int:
        return answered(self.dispatcher.handle(CLIENT, "LOOKUP", LookupRequest(
            "m", 1, [LookupItem.build("x", hashes)]))).hits[0]


def blocks(views: list[torch.Tensor], ids: list[int], dim: int) -> torch.Tensor:
    """The blocks' bytes (random bytes hold NaNs, which never compare equal as floats)."""
    index = torch.tensor(ids)
    return torch.stack([v.view(torch.uint8).index_select(dim, index) for v in views])


async def until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.001)


def test_a_store_waits_for_the_worker_event_and_commits_only_when_the_device_is_done():
    rig = Rig()
    event_handle = b"\x07" * 64
    instance_id, views = rig.register("mha", 1, seed=3, store_event=event_handle)
    (instance,) = rig.registry.instances()
    assert rig.device.opened == [event_handle]
    assert [entry[0] for entry in rig.log] == ["open"]  # three layers, one allocation
    assert instance.stacked is not None  # equal distances in one allocation: one view
    hashes = prompt(1, 2)
    source = list(range(16, 48))

    async def scenario():
        task = asyncio.ensure_future(rig.dispatcher.handle(CLIENT, "STORE", StoreRequest(
            instance_id, [TransferItem.build("r", hashes, source)])))
        # Queued (2 chunks: 2 events each, then each stream's last); the device is not done.
        await until(lambda: len(rig.device.events) == 2 * 2 + 2)
        await asyncio.sleep(0.01)
        assert not task.done()
        assert rig.hits(hashes) == 0 and rig.store.pending == 2
        lane = instance.lane
        # The gathers wait for the worker's event; each DMA, on the copy stream, for its gather.
        assert rig.device.waits[0] == (lane.stream, lane.store_event)
        assert [stream for stream, _ in rig.device.waits[1:]] == [lane.copy_stream] * 2
        rig.device.release()
        reply = await asyncio.wait_for(task, 5)
        assert reply.results == [bytes([StoreStatus.STORED] * 2)]
        assert rig.hits(hashes) == 2 and rig.store.pending == 0
    asyncio.run(scenario())

    # The bytes went through the staging chunk into the pool: retrieve them elsewhere.
    target_id, target = rig.register("mha", 2, seed=None)
    targets = list(range(63, 31, -1))
    targets[3] = SKIP_BLOCK

    async def retrieve():
        before = len(rig.device.events)
        pending = rig.dispatcher.handle(CLIENT, "RETRIEVE", RetrieveRequest(
            target_id, [TransferItem.build("r", hashes, targets)]))
        task = asyncio.ensure_future(pending)
        # Per chunk one event per stream, then the final one of each stream.
        await until(lambda: len(rig.device.events) == before + 2 * 2 + 2)
        rig.device.release()
        return await asyncio.wait_for(task, 5)
    assert asyncio.run(retrieve()).retrieved == [2]
    written = [i for i, b in enumerate(targets) if b != SKIP_BLOCK]
    assert torch.equal(blocks(target, [targets[i] for i in written], 1),
                       blocks(views, [source[i] for i in written], 1))
    assert bool((blocks(target, [60], 1) == 0).all())  # block 60 was SKIP_BLOCK: untouched
    rig.store.check_invariants()


def test_an_mla_leader_fills_its_followers_device_to_device():
    rig = Rig()
    leader_id, leader = rig.register("mla", 1, seed=5)
    follower_id, follower = rig.register("mla", 2, seed=None, tp_rank=1)
    hashes = prompt(2, 1)

    async def scenario():
        store = asyncio.ensure_future(rig.dispatcher.handle(CLIENT, "STORE", StoreRequest(
            leader_id, [TransferItem.build("w", hashes, list(range(16)))])))
        await until(lambda: len(rig.device.events) == 4)  # all queued
        rig.device.release()
        await asyncio.wait_for(store, 5)
        retrieve = asyncio.ensure_future(rig.dispatcher.handle(CLIENT, "RETRIEVE", RetrieveRequest(
            leader_id, [TransferItem.build("g", hashes, list(range(32, 48)))])))
        # The STORE's 2 per chunk and 2 final ones, then the RETRIEVE's: one for the DMA, one
        # for the leader's scatter, one for the follower's, and the final ones of 3 streams.
        await until(lambda: len(rig.device.events) == 4 + 6)
        await asyncio.sleep(0.01)
        assert not retrieve.done() and not rig.pushed  # nobody is told before the device is done
        rig.device.release()
        return await asyncio.wait_for(retrieve, 5)
    assert asyncio.run(scenario()).retrieved == [1]
    expected = blocks(leader, list(range(16)), 0)
    assert torch.equal(blocks(leader, list(range(32, 48)), 0), expected)
    assert torch.equal(blocks(follower, list(range(32, 48)), 0), expected)
    ((_, notice),) = rig.pushed
    assert isinstance(notice, LoadDone) and notice.instance_id == follower_id
    assert notice.items[0].retrieved == 1
    # The STORE's DMA waited for its gather; then the leader's scatter for the DMA, and so
    # did the follower's copy (beside the scatter: both only read the staging chunk).
    lanes = {i.instance_id: i.lane for i in rig.registry.instances()}
    assert [stream for stream, _ in rig.device.waits] == [
        lanes[leader_id].copy_stream, lanes[leader_id].stream, lanes[follower_id].stream]


def test_a_stalled_device_fails_the_request_and_frees_nothing_until_it_finishes():
    rig = Rig(timeout=0.05)
    instance_id, _ = rig.register("mha", 1, seed=3)
    hashes = prompt(3, 2)

    async def scenario():
        with pytest.raises(InternalError, match="did not finish within 0.05 s"):
            await rig.dispatcher.handle(CLIENT, "STORE", StoreRequest(
                instance_id, [TransferItem.build("r", hashes, list(range(32)))]))
        # The device may still write into the chunks, and read the worker's memory.
        assert rig.store.pending == 2 and rig.store.bytes_used > 0
        rig.dispatcher.handle(CLIENT, "UNREGISTER_KV_CACHE", UnregisterKVCacheRequest(instance_id))
        assert ("close", rig.memory[bytes([1]) * 64].data_ptr()) not in rig.log
        rig.device.release()
        await until(lambda: rig.store.pending == 0)
        assert rig.store.bytes_used == 0 and rig.hits(hashes) == 0
        assert rig.log[-1][0] == "close"
        rig.copier.shutdown()
    asyncio.run(scenario())


def test_a_request_refreshes_its_own_connections_registrations_only():
    """Each request marks its connection's registrations alive, found by owner (not by a
    walk over every registration), and a silent connection's expire on their own."""
    rig = Rig()
    other = b"another worker"
    rig.sessions.open(other, "", "another engine")
    mine, _ = rig.register("mha", 1, None)
    theirs, _ = rig.register("mha", 2, None, client=other)
    for instance in rig.registry.instances():
        instance.last_seen = 0.0
    rig.dispatcher.note_request(CLIENT, "LOOKUP")
    assert rig.registry.expired(timeout=60.0) == [theirs]
    assert rig.registry.owns_any(other)
    rig.registry.unregister(theirs)
    assert not rig.registry.owns_any(other) and rig.registry.owns_any(CLIENT)
    assert rig.registry.expired(timeout=60.0) == []
    rig.registry.unregister(mine)
    assert not rig.registry.owns_any(CLIENT)


def test_an_mla_group_is_found_within_its_engine_only():
    """A leader's followers: the other ranks of its engine (their own connections), never a
    rank of another engine with the same group, model and shape."""
    rig = Rig()
    rank_1, stranger = b"rank 1", b"another engine's rank 1"
    rig.sessions.open(rank_1, "", "the rig's engine")
    rig.sessions.open(stranger, "", "another engine")
    leader_id, _ = rig.register("mla", 1, None)
    follower_id, _ = rig.register("mla", 2, None, tp_rank=1, client=rank_1)
    rig.register("mla", 3, None, tp_rank=1, client=stranger)
    leader = rig.registry.get(leader_id, CLIENT)
    assert [i.instance_id for i in rig.registry.tp_followers(leader)] == [follower_id]
    rig.registry.unregister(follower_id)
    assert rig.registry.tp_followers(leader) == []


def test_bad_cuda_ipc_registrations_are_refused_and_close_what_they_opened():
    rig = Rig()
    handle = rig.allocation(9, 4096, seed=None)
    good = CudaIpcHandle(handle, 0, UUID, [4, BLOCK, 8], [BLOCK * 8, 8, 1], "float16")

    def register(*layers, store_event=b""):
        return rig.registry.register(CLIENT, rig.engine, RegisterKVCacheRequest(
            "m", 1, 0, "mla", BLOCK, list(layers), store_event=store_event))

    cases = [
        ((CudaIpcHandle(b"\x01" * 8, 0, UUID, good.shape, good.strides, "float16"),),
         "`layers[0].ipc_handle`: expected 64 bytes"),
        ((CudaIpcHandle(handle, 0, "GPU-1", good.shape, good.strides, "float16"),),
         "`layers[0].device_uuid`: not a GPU UUID"),
        ((CudaIpcHandle(handle, 0, UUID.replace("5", "6"), good.shape, good.strides,
                        "float16"),), "no GPU with UUID"),
        ((good, CudaIpcHandle(handle, 3584, UUID, good.shape, good.strides, "float16")),
         "`layers[1]`: tensor ends at byte 4608 but its CUDA allocation holds 4096 bytes"),
        ((good, MemfdHandle(b"x" * 16, 0, good.shape, good.strides, "float16")),
         "`layers[1].kind`: every layer needs the kind of layers[0] ('cuda_ipc')"),
    ]
    for layers, words in cases:
        with pytest.raises(BadRequest) as error:
            register(*layers)
        assert words in str(error.value), str(error.value)
    with pytest.raises(BadRequest, match="`store_event`: expected 64 bytes"):
        register(good, store_event=b"\x00" * 3)
    with pytest.raises(BadRequest, match="`store_event`: only cuda_ipc registrations"):
        rig.registry.register(CLIENT, rig.engine, RegisterKVCacheRequest(
            "m", 1, 0, "mla", BLOCK, [MemfdHandle(b"x" * 16, 0, good.shape, good.strides,
                                                  "float16")],
            store_event=b"\x00" * 64))
    opens = sum(1 for entry in rig.log if entry[0] == "open")
    closes = sum(1 for entry in rig.log if entry[0] == "close")
    assert opens == closes == 1  # the overrun opened the allocation once, and closed it
    instance = register(good)
    rig.registry.unregister(instance.instance_id)
    assert rig.log[-1] == ("close", rig.memory[handle].data_ptr())
    assert len(rig.registry) == 0


def test_a_handle_the_driver_cannot_open_gets_a_bad_request_that_names_the_causes():
    rig = Rig()
    handle = rig.allocation(9, 4096, seed=None)

    def refuse(handle: bytes, index: int):
        raise RuntimeError("cudaErrorInvalidValue: invalid argument")  # what cupy raises
    rig.shared = SharedAllocations(refuse)
    rig.registry.cuda_ipc = CudaIpcSupport(rig.shared.open, lambda uuid: 0, rig.copier.new_lane)
    request = RegisterKVCacheRequest("m", 1, 0, "mla", BLOCK, [CudaIpcHandle(
        handle, 0, UUID, [4, BLOCK, 8], [BLOCK * 8, 8, 1], "float16")])
    with pytest.raises(BadRequest) as error:
        rig.dispatcher.handle(CLIENT, "REGISTER_KV_CACHE", request)
    words = str(error.value)
    assert words.startswith("`layers[0].ipc_handle`: cannot open it on GPU 0 (RuntimeError: "
                            "cudaErrorInvalidValue: invalid argument)"), words
    assert "expandable_segments, cudaMallocAsync, vLLM's sleep mode" in words
    assert len(rig.registry) == 0 and len(rig.shared) == 0


def test_registering_the_same_memory_twice_opens_it_once_and_closes_it_after_both():
    rig = Rig()
    first, _ = rig.register("mla", 4, seed=1)
    handles = [h for h in rig.registry.instances()[0].allocations]
    assert len(handles) == 1 and len(rig.shared) == 1
    request = RegisterKVCacheRequest("m", 1, 0, "mla", BLOCK, [CudaIpcHandle(
        bytes([4]) * 64, 4096, UUID, [BLOCKS, BLOCK, 64], [BLOCK * 64, 64, 1], "float16")])
    second = rig.registry.register(CLIENT, rig.engine, request).instance_id
    assert [entry[0] for entry in rig.log] == ["open"]
    rig.registry.unregister(first)
    assert [entry[0] for entry in rig.log] == ["open"] and len(rig.shared) == 1
    rig.registry.unregister(second)
    assert [entry[0] for entry in rig.log] == ["open", "close"] and len(rig.shared) == 0


def answered(reply: Any | Awaitable[Any]) -> Any:
    """The dispatcher's reply to an op it answers at once (not an awaitable of one)."""
    assert not inspect.isawaitable(reply), "answered later: await it"
    return reply


async def released(rig: Rig, request) -> Any:
    """The dispatcher's reply to `request`, its device work released as it is queued."""
    task = asyncio.ensure_future(request)
    while not task.done():
        rig.device.release()
        await asyncio.sleep(0.001)
    return task.result()


@pytest.mark.parametrize("layout", ["mha", "mla"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_round_trips_through_the_stream_copier(dtype, layout):
    rig = Rig()
    source_id, source = rig.register(layout, 1, seed=7, dtype=dtype)
    target_id, target = rig.register(layout, 2, seed=None, dtype=dtype)
    assert all(not staging.dtype.is_floating_point for i in rig.registry.instances()
               for staging in i.lane.staging)
    hashes = prompt(4, 2)
    read = list(range(16, 48))
    written = list(range(63, 31, -1))
    written[5] = SKIP_BLOCK

    async def scenario():
        stored = await released(rig, rig.dispatcher.handle(CLIENT, "STORE", StoreRequest(
            source_id, [TransferItem.build("s", hashes, read)])))
        assert stored.results == [bytes([StoreStatus.STORED] * 2)]
        return await released(rig, rig.dispatcher.handle(CLIENT, "RETRIEVE", RetrieveRequest(
            target_id, [TransferItem.build("r", hashes, written)])))
    assert asyncio.run(scenario()).retrieved == [2]
    dim = 1 if layout == "mha" else 0
    kept = [i for i, block in enumerate(written) if block != SKIP_BLOCK]
    assert torch.equal(blocks(target, [written[i] for i in kept], dim),
                       blocks(source, [read[i] for i in kept], dim))
    assert bool((blocks(target, [58], dim) == 0).all())  # SKIP_BLOCK's block: untouched
    rig.copier.shutdown()


class CopyDtypes(TorchFunctionMode):
    """The dtypes of the tensors that index_select, index_copy_ and copy_ are called with."""

    def __init__(self):
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in ("index_select", "index_copy_", "copy_"):
            self.seen |= {t.dtype for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
        return func(*args, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gathers_and_scatters_move_integers_only(dtype):
    """CUDA has no index_copy_ for float8 (nor, before recent torch, index_select): every
    copy of either path, the CPU copy engine's and the stream copier's, moves integers."""
    rig = Rig()
    rig.register("mha", 1, seed=3, dtype=dtype)
    (instance,) = rig.registry.instances()
    chunk = torch.zeros(instance.geometry.chunk_shape, dtype=DTYPES[dtype])
    ids = torch.arange(16, 32)
    with_skips = ids.clone()
    with_skips[2] = SKIP_BLOCK
    with CopyDtypes() as cpu_path:
        instance.gather(ids, chunk)
        instance.scatter(with_skips, chunk, has_skips=True)
    with CopyDtypes() as gpu_path:
        rig.copier._gather(instance, ids, chunk)
        rig.copier._scatter(instance, 0, ids[3:], chunk, torch.arange(3, 16))
    for seen in (cpu_path.seen, gpu_path.seen):
        assert seen and not any(d.is_floating_point for d in seen), seen


def test_the_loop_sleeps_while_the_device_copies():
    """uvloop rounds timer delays to whole milliseconds: a sub-millisecond poll of the
    events would become call_soon, and the loop thread would spin for the whole copy."""
    uvloop = pytest.importorskip("uvloop")
    rig = Rig()
    instance_id, _ = rig.register("mha", 1, seed=3)
    hashes = prompt(5, 2)

    async def scenario():
        task = asyncio.ensure_future(rig.dispatcher.handle(CLIENT, "STORE", StoreRequest(
            instance_id, [TransferItem.build("r", hashes, list(range(32)))])))
        await until(lambda: rig.device.events)
        cpu, wall = time.thread_time(), time.monotonic()
        await asyncio.sleep(0.5)  # the copy is pending: the loop polls its event meanwhile
        cpu, wall = time.thread_time() - cpu, time.monotonic() - wall
        assert not task.done()
        rig.device.release()
        await asyncio.wait_for(task, 5)
        return cpu / wall
    busy = uvloop.run(scenario())  # as the server runs its loop (asyncio.Runner is 3.11's)
    rig.copier.shutdown()
    assert busy < 0.2, f"the loop thread was busy {busy:.0%} of the time"


class OrderedDevice(FakeDevice):
    """A FakeDevice that knows what a GPU would run in which order: each stream keeps a
    vector clock; record() takes a stream's clock, wait() merges it into another's. Every
    copy that touches a staging chunk is logged with the clock of the stream it was queued
    on, so a test can tell which copies the events order and which may overlap."""

    def __init__(self):
        super().__init__()
        self.current: str | None = None
        self.clocks: dict[str, dict[str, int]] = {}
        self.log: list[tuple[str, int, dict[str, int], str, bool]] = []

    @contextlib.contextmanager
    def use(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def record(self, stream):
        event = super().record(stream)
        event.clock = dict(self.clocks.setdefault(stream, {}))
        return event

    def wait(self, stream, event):
        super().wait(stream, event)
        clock = self.clocks.setdefault(stream, {})
        for other, tick in getattr(event, "clock", {}).items():
            clock[other] = max(clock.get(other, 0), tick)

    def touch(self, buffer: str, writes: bool) -> None:
        stream = self.current
        assert stream is not None, "a staging chunk is copied on a stream the copier uses"
        clock = self.clocks.setdefault(stream, {})
        clock[stream] = clock.get(stream, 0) + 1
        self.log.append((stream, clock[stream], dict(clock), buffer, writes))

    def ordered(self, first, then) -> bool:
        """Whether the device runs log entry `then` only after `first` has finished."""
        return then[2].get(first[0], 0) >= first[1]

    def races(self) -> list:
        """Pairs of accesses to one staging chunk, one a write, that nothing orders."""
        return [(a, b) for i, a in enumerate(self.log) for b in self.log[i + 1:]
                if a[3] == b[3] and (a[4] or b[4]) and not self.ordered(a, b)]


class StagingAccesses(TorchFunctionMode):
    """Tells the device which staging chunk each copy reads or writes."""

    def __init__(self, device: OrderedDevice, staging: dict[int, str]):
        super().__init__()
        self.device, self.staging = device, staging

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("index_select", "index_copy_", "copy_"):
            written = kwargs.get("out") if name == "index_select" else args[0]
            for tensor in (*args, *kwargs.values()):
                if isinstance(tensor, torch.Tensor):
                    buffer = self.staging.get(tensor.untyped_storage().data_ptr())
                    if buffer is not None:
                        self.device.touch(buffer, tensor is written)
        return func(*args, **kwargs)


class Careless(StreamCopier):
    """Double-buffered without the rule: a staging chunk's next use waits for nothing."""

    @contextlib.contextmanager
    def _claim(self, lane, index, stream, writes):
        yield


def _staging_traffic(copier: type) -> OrderedDevice:
    """An MLA leader and its follower on an OrderedDevice: a STORE of 4 chunks, a RETRIEVE
    of them (fanned out to the follower), and another STORE."""
    device = OrderedDevice()
    rig = Rig(device=device, copier=copier)
    leader_id, _ = rig.register("mla", 1, seed=5)
    rig.register("mla", 2, seed=None, tp_rank=1)
    staging = {buffer.untyped_storage().data_ptr(): f"{i.instance_id}/{k}"
               for i in rig.registry.instances() for k, buffer in enumerate(i.lane.staging)}
    hashes = prompt(9, 4)

    async def run(request):
        op = type(request).__name__.removesuffix("Request").upper()
        task = asyncio.ensure_future(rig.dispatcher.handle(CLIENT, op, request))
        while not task.done():
            device.release()
            await asyncio.sleep(0.001)
        return task.result()

    # Torch function modes are per thread: watch the copier's (one) queueing thread.
    accesses = StagingAccesses(device, staging)
    rig.copier._executor.submit(accesses.__enter__).result()

    async def scenario():
        stored = await run(StoreRequest(leader_id, [TransferItem.build(
            "w", hashes, list(range(64)))]))
        assert stored.results == [bytes([StoreStatus.STORED] * 4)]
        retrieved = await run(RetrieveRequest(leader_id, [TransferItem.build(
            "g", hashes, list(range(63, -1, -1)))]))
        assert retrieved.retrieved == [4]
        await run(StoreRequest(leader_id, [TransferItem.build(
            "w2", prompt(10, 2), list(range(32)))]))
    asyncio.run(scenario())
    rig.copier._executor.submit(accesses.__exit__, None, None, None).result()
    rig.copier.shutdown()
    return device


def test_a_staging_chunk_is_never_reused_before_its_copy_completes_and_gathers_overlap_dmas():
    device = _staging_traffic(StreamCopier)
    assert len(device.log) > 30 and device.races() == []
    # Double buffering: the gather of each chunk of a STORE may run while the DMA of the
    # chunk before it does (nothing orders them), on two streams.
    leader = device.log[0][3].split("/")[0]
    gathers = [e for e in device.log if e[4] and e[3].startswith(leader)][:4]
    dmas = [e for e in device.log if not e[4] and e[3].startswith(leader)][:4]
    assert {e[0] for e in gathers}.isdisjoint({e[0] for e in dmas})
    assert [e[3] for e in gathers] == [f"{leader}/{k % 2}" for k in range(4)]
    assert not any(device.ordered(dma, gather) for dma, gather in zip(dmas, gathers[1:]))


def test_the_staging_check_finds_a_copier_that_reuses_a_chunk_too_soon():
    assert _staging_traffic(Careless).races() != []
