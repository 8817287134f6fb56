"""The GPU copy path's ordering on the CPU, on a fake device that queues copies as torch does.

test_streams.py's OrderedDevice follows the staging chunks. TorchOrder follows every byte a
copy touches: the worker's blocks, the staging chunks, pool chunks and GPU-tier extents,
each on the GPU (or the host) it lives on, and queues each copy on the stream torch would:
a kernel on the current stream of its tensors' GPU, a copy between two GPUs on the source
GPU's current stream, fenced both ways against the target GPU's current one (torch's
copy_device_to_device in aten/src/ATen/native/cuda/Copy.cu). Streams keep vector clocks;
an event carries its stream's clock when recorded; the host learns an event's clock when
query() finds it complete, and any work queued after that is ordered after it. A race is
two accesses to overlapping bytes, one a write, that nothing orders. The worker is the
test: it writes and reads its blocks on a stream of its own and records its store event.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from lmcache_mp.protocol import RetrieveRequest, StoreRequest, StoreStatus, TransferItem
from lmcache_mp.server.copy.streams import StreamCopier
from lmcache_mp.server.memory.cuda_ipc import CudaIpcSupport

from ...workers import prompt
from .test_streams import CLIENT, PER_CHUNK, FakeDevice, FakeEvent, Rig

Clock = dict[str, int]


def _merge(into: Clock, other: Clock) -> None:
    for stream, tick in other.items():
        into[stream] = max(into.get(stream, 0), tick)


def _span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The bytes a tensor's elements lie in, [first, end); None for an empty one."""
    if tensor.numel() == 0:
        return None
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return start, start + (last + 1) * tensor.element_size()


@dataclass
class Access:
    stream: str
    tick: int  # the stream's own count at this access
    clock: Clock  # what the stream had waited for by then
    region: str
    start: int
    end: int
    writes: bool


class TorchOrder(FakeDevice):
    """The Device interface on the CPU with torch's stream semantics (see the module's doc)."""

    def __init__(self):
        super().__init__()
        self.gpu_of: dict[str, int] = {}  # stream -> its GPU
        self.current: dict[int, str] = {}  # GPU -> its current stream, where one is set
        self.clocks: dict[str, Clock] = {}
        self.host: Clock = {}  # what the host knows to have finished
        self.regions: list[tuple[int, int, int | None, str]] = []  # start, end, GPU, name
        self.log: list[Access] = []
        self.worker_events: dict[bytes, FakeEvent] = {}

    # -- the Device interface ----------------------------------------------------------

    def new_stream(self, device):
        stream = super().new_stream(device)
        self.gpu_of[stream] = device.index or 0
        return stream

    @contextlib.contextmanager
    def use(self, stream):
        gpu = self.gpu_of[stream]
        previous = self.current.get(gpu)
        self.current[gpu] = stream
        try:
            yield
        finally:
            if previous is None:
                del self.current[gpu]
            else:
                self.current[gpu] = previous

    def record(self, stream):
        event = super().record(stream)
        event.clock = dict(self.clock(stream))
        return event

    def wait(self, stream, event):
        super().wait(stream, event)
        _merge(self.clock(stream), getattr(event, "clock", {}))

    def query(self, event):
        if event.done:
            _merge(self.host, getattr(event, "clock", {}))
        return event.done

    def open_event(self, device, handle):
        self.opened.append(handle)
        return self.worker_events.setdefault(handle, FakeEvent(done=True))

    # -- what the test and the torch mode tell it ----------------------------------------

    def clock(self, stream: str) -> Clock:
        return self.clocks.setdefault(stream, {})

    def region(self, tensor: torch.Tensor, gpu: int | None, name: str) -> None:
        """Follow the accesses to `tensor`'s bytes, which live on `gpu` (None: the host)."""
        span = _span(tensor)
        assert span is not None
        self.regions.append((*span, gpu, name))

    def where(self, tensor: torch.Tensor) -> tuple[int | None, str] | None:
        span = _span(tensor)
        for start, end, gpu, name in self.regions:
            if span is not None and start <= span[0] < end:
                return gpu, name
        return None  # index tensors and scratch space: not followed

    def stream_on(self, gpu: int) -> str:
        stream = self.current.get(gpu, f"default-{gpu}")
        self.gpu_of.setdefault(stream, gpu)
        return stream

    def access(self, stream: str, tensors: list[tuple[torch.Tensor, bool]]) -> None:
        """One piece of work queued on `stream` now, reading or writing each tensor."""
        clock = self.clock(stream)
        _merge(clock, self.host)
        clock[stream] = clock.get(stream, 0) + 1
        for tensor, writes in tensors:
            found, span = self.where(tensor), _span(tensor)
            if found is not None and span is not None:
                self.log.append(Access(stream, clock[stream], dict(clock), found[1], *span,
                                       writes))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst.copy_(src), on the stream torch picks."""
        to, of = self.where(dst), self.where(src)
        to_gpu, from_gpu = (to or (None, ""))[0], (of or (None, ""))[0]
        if to_gpu is not None and from_gpu is not None and to_gpu != from_gpu:
            stream, target = self.stream_on(from_gpu), self.stream_on(to_gpu)
            _merge(self.clock(stream), self.clock(target))  # the source waits for the target
            self.access(stream, [(src, False), (dst, True)])
            _merge(self.clock(target), self.clock(stream))  # and the target for the copy
        elif to_gpu is not None or from_gpu is not None:
            gpu = to_gpu if to_gpu is not None else from_gpu
            assert gpu is not None  # one of the two, by the condition
            self.access(self.stream_on(gpu), [(src, False), (dst, True)])

    def kernel(self, out: torch.Tensor | None, inputs: list[torch.Tensor]) -> None:
        """An index kernel writing `out` (None: scratch) from `inputs`, on their GPU."""
        placed = [self.where(t) for t in ([out] if out is not None else []) + inputs]
        gpus = [p[0] for p in placed if p is not None and p[0] is not None]
        if gpus:
            self.access(self.stream_on(gpus[0]), [(t, False) for t in inputs]
                        + ([(out, True)] if out is not None else []))

    # -- the worker --------------------------------------------------------------------

    def worker(self, gpu: int) -> str:
        stream = f"worker-{gpu}"
        self.gpu_of[stream] = gpu
        return stream

    def record_worker_event(self, handle: bytes, stream: str) -> None:
        self.worker_events[handle].clock = dict(self.clock(stream))

    def host_waits(self, stream: str) -> None:
        """The host waits for everything queued on `stream` (vLLM reads a step's output)."""
        _merge(self.host, self.clock(stream))

    # -- verdicts ----------------------------------------------------------------------

    @staticmethod
    def ordered(first: Access, then: Access) -> bool:
        return then.clock.get(first.stream, 0) >= first.tick

    def races(self) -> list[tuple[Access, Access]]:
        return [(a, b) for i, a in enumerate(self.log) for b in self.log[i + 1:]
                if (a.writes or b.writes) and a.start < b.end and b.start < a.end
                and not self.ordered(a, b)]


class TorchRules(TorchFunctionMode):
    """Tells a TorchOrder about each copy and index kernel, as it is queued."""

    def __init__(self, device: TorchOrder):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "copy_":
            self.device.copy(args[0], args[1])
        elif name == "index_select":
            self.device.kernel(kwargs.get("out"), [args[0]])
        elif name == "index_copy_":
            self.device.kernel(args[0], [args[3] if len(args) > 3 else kwargs["source"]])
        return func(*args, **kwargs)


class GpuRig(Rig):
    """A Rig on a TorchOrder whose workers live on the GPUs the test names; the GPU tier is
    on GPU 0 and the pool on the host. Run its requests with run(), which watches the
    copier's thread."""

    device: TorchOrder

    def __init__(self, copier: type = StreamCopier, **kwargs):
        super().__init__(device=TorchOrder(), copier=copier, **kwargs)
        self.gpu = 0  # where the registration being set up lives
        self.registry.cuda_ipc = CudaIpcSupport(self.shared.open, lambda uuid: self.gpu,
                                                self.new_lane)
        self.device.region(self.pool.buffer, None, "pool")
        if self.gpu_pool is not None:
            self.device.region(self.gpu_pool.buffer, 0, "gpu tier")
        # Torch function modes are per thread: the copier queues on its one thread.
        self.rules = TorchRules(self.device)
        self.copier._executor.submit(self.rules.__enter__).result()

    def new_lane(self, device, geometry, store_event):
        lane = self.copier.new_lane(torch.device("cpu", self.gpu), geometry, store_event)
        for k, staging in enumerate(lane.staging):
            self.device.region(staging, self.gpu, f"staging {k} on GPU {self.gpu}")
        return lane

    def register_on(self, gpu: int, layout: str, tag: int, seed: int | None, **kwargs):
        self.gpu = gpu
        instance_id, views = self.register(layout, tag, seed, **kwargs)
        self.device.region(self.memory[bytes([tag]) * 64], gpu, f"worker {tag}")
        return instance_id, views

    def run(self, request):
        op = type(request).__name__.removesuffix("Request").upper()

        async def released():
            task = asyncio.ensure_future(self.dispatcher.handle(CLIENT, op, request))
            while not task.done():
                self.device.release()
                await asyncio.sleep(0.001)
            return task.result()
        return asyncio.run(released())

    def close(self) -> None:
        self.copier._executor.submit(self.rules.__exit__, None, None, None).result()
        self.copier.shutdown()


EVENT = b"\x05" * 64


def _store_after_the_worker_writes(use_event: bool) -> TorchOrder:
    """The worker writes two chunks' blocks on its stream, records its store event, and
    sends STORE at once, while those writes may still run."""
    rig = GpuRig()
    instance_id, views = rig.register_on(0, "mha", 1, seed=3,
                                         store_event=EVENT if use_event else b"")
    stream = rig.device.worker(0)
    rig.device.access(stream, [(view.narrow(1, 0, 2 * PER_CHUNK), True) for view in views])
    if use_event:
        rig.device.record_worker_event(EVENT, stream)
    reply = rig.run(StoreRequest(instance_id, [TransferItem.build(
        "w", prompt(50, 2), list(range(2 * PER_CHUNK)))]))
    assert reply.results == [bytes([StoreStatus.STORED] * 2)]
    rig.close()
    return rig.device


def test_a_store_reads_the_blocks_only_after_the_workers_event():
    device = _store_after_the_worker_writes(use_event=True)
    reads = [a for a in device.log if a.region == "worker 1" and not a.writes]
    assert reads and device.races() == []


def test_a_store_without_the_event_would_read_blocks_still_being_written():
    races = _store_after_the_worker_writes(use_event=False).races()
    assert races and all(a.stream == "worker-0" and b.region == "worker 1" for a, b in races)


class Hasty(StreamCopier):
    """Answers a RETRIEVE once its DMAs are done, not its scatters into the blocks."""

    def _queue_retrieve(self, targets, jobs, deadline):
        errors, events = super()._queue_retrieve(targets, jobs, deadline)
        return errors, events[:1]


def _retrieve_then_the_worker_reads(copier: type = StreamCopier,
                                    synced: bool = True) -> TorchOrder:
    """A chunk stored, then retrieved into blocks the worker last wrote on its stream
    (`synced`: and whose results the host has read since, as vLLM has before it frees
    them); once the reply is in, the worker reads them on its stream."""
    rig = GpuRig(copier=copier)
    source_id, _ = rig.register_on(0, "mha", 1, seed=3)
    target_id, target = rig.register_on(0, "mha", 2, seed=None)
    hashes = prompt(51, 1)
    rig.run(StoreRequest(source_id, [TransferItem.build("w", hashes, list(range(PER_CHUNK)))]))
    stream = rig.device.worker(0)
    blocks = [view.narrow(1, PER_CHUNK, PER_CHUNK) for view in target]
    rig.device.access(stream, [(b, True) for b in blocks])  # an earlier request's forward
    if synced:
        rig.device.host_waits(stream)
    reply = rig.run(RetrieveRequest(target_id, [TransferItem.build(
        "r", hashes, list(range(PER_CHUNK, 2 * PER_CHUNK)))]))
    assert reply.retrieved == [1]
    rig.device.access(stream, [(b, False) for b in blocks])  # the next forward pass
    rig.close()
    return rig.device


def test_a_retrieve_needs_no_worker_event():
    """The server writes blocks nobody's queued work touches (vLLM hands a request blocks
    whose earlier users have finished, which the host learnt from their outputs), and
    replies only once its own writes have finished: both sides are ordered by the host."""
    device = _retrieve_then_the_worker_reads()
    assert [a for a in device.log if a.region == "worker 2" and a.writes and
            not a.stream.startswith("worker")]
    assert device.races() == []


def test_the_retrieve_checks_catch_a_hasty_reply_and_blocks_still_in_use():
    hasty = _retrieve_then_the_worker_reads(Hasty).races()
    assert hasty and all(b.stream == "worker-0" for _, b in hasty)
    busy = _retrieve_then_the_worker_reads(synced=False).races()
    assert busy and all(a.stream == "worker-0" for a, _ in busy)


class OneStreamFanOut(StreamCopier):
    """The fan-out before per-follower links: every follower's copy on the leader's stream."""

    def _fan_out(self, leader, index, follower, block_ids, positions):
        device, mine, theirs = self.device, leader.lane, follower.lane
        with device.use(theirs.stream), self._claim(mine, index, theirs.stream, writes=False):
            theirs.staging[0].copy_(mine.staging[index], non_blocking=True)
            follower.scatter_blocks(block_ids, theirs.staging[0], positions)


def _fan_out(copier: type) -> tuple[TorchOrder, list[torch.Tensor], list[list[torch.Tensor]]]:
    """An MLA leader on GPU 0 stores two chunks and retrieves them into itself and two
    followers, on GPUs 1 and 2."""
    rig = GpuRig(copier=copier)
    leader_id, leader = rig.register_on(0, "mla", 1, seed=5)
    followers = [rig.register_on(gpu, "mla", 1 + gpu, seed=None, tp_rank=gpu)[1]
                 for gpu in (1, 2)]
    hashes = prompt(52, 2)
    rig.run(StoreRequest(leader_id, [TransferItem.build("w", hashes, list(range(32)))]))
    assert rig.run(RetrieveRequest(leader_id, [TransferItem.build(
        "g", hashes, list(range(32, 64)))])).retrieved == [2]
    rig.close()
    return rig.device, leader, followers


def test_followers_on_other_gpus_copy_side_by_side():
    device, leader, followers = _fan_out(StreamCopier)
    assert device.races() == []
    for follower in followers:
        assert all(torch.equal(f[32:64].view(torch.uint8), mine[:32].view(torch.uint8))
                   for f, mine in zip(follower, leader))  # bytes: random ones hold NaNs
    first, second = ([a for a in device.log if a.region == f"staging 0 on GPU {gpu}"
                      and a.writes] for gpu in (1, 2))
    assert len(first) == len(second) == 2  # each follower: a copy per chunk
    # Each copy runs on a stream of its follower's, on the leader's GPU; nothing orders
    # one follower's copies after the other's.
    assert {a.stream for a in first}.isdisjoint({a.stream for a in second})
    assert not any(device.ordered(a, b) or device.ordered(b, a) for a in first for b in second)


def test_the_fan_out_check_catches_followers_queued_on_the_leaders_stream():
    device, _, _ = _fan_out(OneStreamFanOut)
    first, second = ([a for a in device.log if a.region == f"staging 0 on GPU {gpu}"
                      and a.writes] for gpu in (1, 2))
    assert device.ordered(first[0], second[0])
