"""Registered worker KV caches: validating and mapping their handles, and tracking liveness."""

from __future__ import annotations

import logging
import math
import mmap
import secrets
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import BadRequest, UnknownInstance
from ..fdpass import FD_CHANNEL_MAGIC
from ..memory import data_runs, populate
from ..protocol import (
    CUDA_IPC_HANDLE_BYTES,
    MAX_KV_WORLD_SIZE,
    MAX_LAYERS,
    MAX_MODEL_CHARS,
    MAX_NAME_CHARS,
    MAX_REGISTERED_BYTES_PER_CONNECTION,
    MAX_REGISTERED_BYTES_PER_UID,
    MAX_REGISTRATIONS,
    MAX_REGISTRATIONS_PER_CONNECTION,
    SKIP_BLOCK,
    TICKET_BYTES,
    MemfdHandle,
    RegisterKVCacheRequest,
    TensorHandle,
    span_bytes,
)
from .cuda_ipc import Allocation, CudaIpcSupport, open_allocations

logger = logging.getLogger(__name__)

LAYOUTS = {"mha": 5, "mla": 3}  # tensor rank of one layer
# A memfd may hold at most this much beyond twice its layers' extent: the server maps only
# the extent, and a registration keeps no more than that of a worker's memory alive.
SEGMENT_SLACK_BYTES = 1024**2
# Runs of a segment's data pre-faulted at most: a segment more fragmented than that is the
# worker's doing, and the rest of its pages fault in at their first copy.
MAX_PREFAULT_RUNS = 1024
# fd_channel.FdChannel.watch: (token, on_hangup) -> how to stop watching, or None
Watch = Callable[[bytes, Callable[[], None]], Callable[[], None] | None]
# Above this many bytes per block (all layers), one copy_ per block beats index_copy_.
_PER_BLOCK_SCATTER_BYTES = 256 * 1024

DTYPES = {name: getattr(torch, name) for name in (
    "float16", "bfloat16", "float32", "float64", "uint8", "int8",
    "float8_e4m3fn", "float8_e5m2")}
# Copies move bytes, never values: through an integer view of the same item size, so that
# every dtype takes the same kernels (CUDA has no index_copy_ for float8, for one).
RAW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory, shape and strides, as integers of the same item size."""
    return tensor.view(RAW_DTYPES[tensor.element_size()])


def _rows(tensor: torch.Tensor, dim: int, width: int) -> torch.Tensor | None:
    """The same memory as [outer, blocks, row] integers of `width` bytes (each block's
    bytes in one row), or None where its strides do not allow such a view."""
    shape = tensor.shape
    outer = math.prod(shape[:dim])
    inner = math.prod(shape[dim + 1:]) * tensor.element_size()
    if inner % width or tensor.data_ptr() % width:
        return None
    try:
        rows = raw(tensor).view(outer, shape[dim], -1)
        return rows.view(RAW_DTYPES[width]) if rows.stride(2) == 1 else None
    except RuntimeError:  # the dimensions around `dim` do not merge without a copy
        return None


ROW_WIDTHS = (8, 4, 2, 1)


@dataclass(frozen=True)
class Geometry:
    """What a stored chunk looks like; chunks only move between caches of equal geometry."""

    layout: str
    num_layers: int
    block_shape: tuple[int, ...]  # one block of one layer: (2, block_size, heads, head_dim) or (block_size, dim)
    dtype: str
    blocks_per_chunk: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        if self.layout == "mha":
            kv, block_size, *rest = self.block_shape
            return (self.num_layers, kv, self.blocks_per_chunk, block_size, *rest)
        return (self.num_layers, self.blocks_per_chunk, *self.block_shape)

    @property
    def chunk_bytes(self) -> int:
        n = self.itemsize
        for dim in self.chunk_shape:
            n *= dim
        return n

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers."""
        return self.chunk_bytes // self.blocks_per_chunk

    @property
    def block_dim(self) -> int:
        """Index of the block dimension in a layer tensor."""
        return 1 if self.layout == "mha" else 0


class HostRows:
    """A cache in CPU memory as numpy rows: runs of bytes contiguous both in the cache and
    in a chunk (a whole block of one layer's K or V when the layout allows, or its
    innermost dimension, as in vLLM's CPU layout with K and V interleaved). A request's
    copies then move each row with one memmove, from index arrays built once per request,
    with no torch view or op per chunk and block (W2's 512 KiB chunks spent more time on
    views than on their bytes; vLLM's CPU caches took a torch copy per block and layer).

    The rows lie in parts: one for a stacked cache, else one per layer, all of one layout.
    A chunk's bytes hold each part's rows in turn, in the chunk's own order."""

    MIN_ROW_BYTES = 64  # below this, rows cost more than torch's strided copies
    # From here up, scatter() assigns byte rows, else np.put()s void rows: per 2 copy
    # threads on memfd memory, 4 KiB rows 29 vs 19 GB/s, 256-byte rows 10 vs 22 GB/s.
    WIDE_ROW_BYTES = 1024

    def __init__(self, parts: list[np.ndarray], outer: np.ndarray, block_stride: int,
                 inner: np.ndarray, layers_per_part: int = 1):
        """`parts`: each a 1-d array of void rows from the part's first byte. Within a part,
        the row of outer position o, block b and inner position i is outer[o] + b ×
        block_stride + inner[i], and a chunk lists them by (o, block, i); the outer
        positions of a part hold `layers_per_part` layers, one after the other."""
        self.parts = parts
        self.layers_per_part = layers_per_part
        row_bytes = parts[0].dtype.itemsize
        self._byte_rows = ([part.view(np.uint8).reshape(-1, row_bytes) for part in parts]
                           if row_bytes >= self.WIDE_ROW_BYTES else None)
        self._outer = outer.reshape(1, -1, 1, 1)
        self._block_stride = block_stride
        self._inner = inner.reshape(1, 1, 1, -1)
        self._row = parts[0].dtype

    @classmethod
    def of(cls, layers: list[torch.Tensor], stacked: torch.Tensor | None, block_dim: int
           ) -> HostRows | None:
        """The rows of a cache on the CPU (its stacked view if it has one, else its layers,
        when they share one layout); None where its strides allow no rows of at least
        MIN_ROW_BYTES."""
        if not layers or layers[0].is_cuda:
            return None
        tensors, dim = ([stacked], block_dim + 1) if stacked is not None else (layers, block_dim)
        shape, strides = tensors[0].shape, tensors[0].stride()
        if any(t.shape != shape or t.stride() != strides for t in tensors):
            return None
        itemsize = tensors[0].element_size()
        run, last = 1, len(shape)  # the trailing dimensions that merge into one run
        while last > dim + 1 and (shape[last - 1] == 1 or strides[last - 1] == run):
            run *= shape[last - 1]
            last -= 1
        indexed = [d for d in range(last) if shape[d] > 1]
        if run * itemsize < cls.MIN_ROW_BYTES or any(strides[d] % run for d in indexed):
            return None

        def offsets(dims: range) -> np.ndarray:
            """Row offsets of every position of `dims`, in their order."""
            grid = np.zeros(1, dtype=np.int64)
            for d in dims:
                grid = (grid[:, None] + np.arange(shape[d]) * (strides[d] // run)).reshape(-1)
            return grid
        extent = 1 + sum((shape[d] - 1) * (strides[d] // run) for d in indexed)
        row = np.dtype((np.void, run * itemsize))
        parts = [torch.empty(0, dtype=torch.uint8).set_(
            t.untyped_storage(), t.storage_offset() * itemsize, (extent * row.itemsize,), (1,)
        ).numpy().view(row) for t in tensors]
        return cls(parts, offsets(range(dim)), strides[dim] // run, offsets(range(dim + 1, last)),
                   len(layers) if stacked is not None else 1)

    def rows(self, block_ids: np.ndarray) -> np.ndarray:
        """The rows of [chunks, blocks] block ids (checked, none SKIP_BLOCK) as [chunks,
        rows of a part], in the order a chunk's bytes hold them within each part."""
        chunks, blocks = block_ids.shape
        return (self._outer + block_ids[:, None, :, None] * self._block_stride
                + self._inner).reshape(chunks, self._outer.size * blocks * self._inner.size)

    def chunk(self, chunk_bytes: np.ndarray) -> np.ndarray:
        """A chunk's bytes (a slice of the pool) as [parts, rows of a part]."""
        return chunk_bytes.view(self._row).reshape(len(self.parts), -1)

    def gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Copy `rows` of every part into `out` (a chunk() view). np.take moves each row with
        one memmove and releases the GIL; mode "clip" (the ids are checked, so it never
        clips) writes straight into `out`, where the default mode buffers."""
        for part, into in zip(self.parts, out):
            np.take(part, rows, out=into, mode="clip")

    def scatter(self, rows: np.ndarray, src: np.ndarray, layer: int | None = None) -> None:
        """Copy `src` (a chunk() view, or the same rows of each of its parts) into `rows` of
        every part, or of layer `layer` only; as gather(), without the GIL."""
        parts = self._byte_rows if self._byte_rows is not None else self.parts
        if layer is not None:
            part, within = divmod(layer, self.layers_per_part)
            per_layer = len(rows) // self.layers_per_part
            layer_rows = slice(within * per_layer, (within + 1) * per_layer)
            parts, rows, src = [parts[part]], rows[layer_rows], src[part:part + 1, layer_rows]
        for part, rows_of_part in zip(parts, src):
            if self._byte_rows is not None:
                # The row width, not -1: no rows (a chunk whose blocks are all skipped) is
                # an empty copy, where numpy cannot infer a width from nothing.
                part[rows] = rows_of_part.view(np.uint8).reshape(len(rows), part.shape[1])
            else:
                np.put(part, rows, rows_of_part, mode="clip")

    def scatter_skipping(self, block_ids: np.ndarray, src: np.ndarray,
                         layer: int | None = None) -> None:
        """scatter() for one chunk's [blocks] ids, some SKIP_BLOCK: those blocks stay alone."""
        keep = block_ids != SKIP_BLOCK
        per_block = src.reshape(len(self.parts), self._outer.size, len(keep), -1)
        self.scatter(self.rows(block_ids[keep].reshape(1, -1))[0],
                     per_block[:, :, keep].reshape(len(self.parts), -1), layer)


@dataclass(eq=False)
class KVCacheInstance:
    """One worker's registered paged KV cache, mapped into this process."""

    instance_id: int
    owner: bytes  # the ZeroMQ identity that registered it
    engine: bytes  # its session's engine: only ranks of the same engine share an MLA group
    model: str
    kv_world_size: int
    kv_worker_id: int
    tp_rank: int
    tp_group: str
    num_blocks: int
    geometry: Geometry
    layers: list[torch.Tensor]
    stacked: torch.Tensor | None  # all layers as one [L, ...] view when their memory allows it
    mappings: list[mmap.mmap]  # shm segments
    last_seen: float
    allocations: list[Allocation] = field(default_factory=list)  # cuda_ipc allocations
    # What of `mappings` holds data, as (mapping, offset, length): all that is pre-faulted.
    prefault: list[tuple[mmap.mmap, int, int]] = field(default_factory=list)
    # Bytes of its memfds' extents, by the uid that sent them: counted against the limits.
    registered: Counter[int] = field(default_factory=Counter)
    lane: Any = None  # its streams.Lane when it lives on a GPU: copies go through the stream copier
    host_rows: HostRows | None = None  # a cache in CPU memory whose strides allow it
    copies_in_flight: int = 0
    closed: bool = False
    stop_watching: Callable[[], None] | None = None  # lets go of its fd channel watch
    stores: int = 0  # STORE requests it sent
    retrieves: int = 0  # RETRIEVE requests it sent
    loads_pushed: int = 0  # LOAD_DONE notices sent to it as an MLA follower
    _populating: threading.Thread | None = None
    # `stacked` as [layers × outer, blocks, row] words, per word width (None: no such view)
    _stacked_rows: dict[int, torch.Tensor | None] = field(default_factory=dict)
    def start_populating(self) -> None:
        """Fault the worker's pages into this process in the background, ahead of the first
        copy: those it allocated only, so that the server allocates none on its account."""
        def run() -> None:
            for mapping, offset, length in self.prefault:
                if not populate(mapping, lambda: self.closed, offset, length):
                    return  # it warned: the kernel cannot, and the next run won't do better
        self._populating = threading.Thread(target=run, name=f"populate-{self.instance_id}",
                                            daemon=True)
        self._populating.start()

    def _as_rows(self, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`stacked` and a chunk-shaped tensor as [outer, blocks, row] views of the widest
        integers both allow: an index kernel then moves 8-byte words, not 2-byte items
        (~4× faster on W2's 4 KiB blocks). None where strides forbid it. The cache's view is
        made once; a contiguous chunk's costs three views."""
        if self.stacked is None:
            return None
        dim = self.geometry.block_dim + 1
        for width in ROW_WIDTHS:
            if width not in self._stacked_rows:
                self._stacked_rows[width] = _rows(self.stacked, dim, width)
            stacked = self._stacked_rows[width]
            if stacked is None:
                continue
            if chunk.is_contiguous() and chunk.data_ptr() % width == 0:
                rows = (chunk.view(-1).view(RAW_DTYPES[width])
                        .view(stacked.shape[0], chunk.shape[dim], stacked.shape[2]))
            else:
                rows = _rows(chunk, dim, width)
            if rows is not None:
                return stacked, rows
        return None

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the given blocks of every layer into `out` (a chunk-shaped tensor on the
        cache's device); `block_ids` may be on the CPU. Bytes move, as integers."""
        dim = self.geometry.block_dim
        block_ids = block_ids.to(out.device, non_blocking=True)
        rows = self._as_rows(out)
        if rows is not None:
            torch.index_select(rows[0], 1, block_ids, out=rows[1])
            return
        out = raw(out)
        if self.stacked is not None:
            torch.index_select(raw(self.stacked), dim + 1, block_ids, out=out)
        else:
            for layer, dest in zip(self.layers, out):
                torch.index_select(raw(layer), dim, block_ids, out=dest)

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor, has_skips: bool = False
                ) -> None:
        """Copy a chunk-shaped tensor into the given blocks of every layer; with `has_skips`,
        a block id of SKIP_BLOCK leaves that block alone (the engine already holds it)."""
        positions = None
        if has_skips:
            positions = (block_ids != SKIP_BLOCK).nonzero().flatten()
            block_ids = block_ids[positions]
        self.scatter_blocks(block_ids, src, positions)

    def scatter_blocks(self, block_ids: torch.Tensor, src: torch.Tensor,
                       positions: torch.Tensor | None) -> None:
        """Copy blocks `positions` of a chunk-shaped tensor (None: all of them) into blocks
        `block_ids` of every layer; the index tensors may be on any device. Bytes move, as
        integers."""
        dim = self.geometry.block_dim
        home = self.layers[0].device
        src = raw(src)
        if src.device != home:  # a chunk in the GPU tier, read into a cache in CPU memory
            src = src.to(home)
        if positions is not None:
            src = src.index_select(dim + 1, positions.to(src.device, non_blocking=True))
        block_ids = block_ids.to(src.device, non_blocking=True)
        targets = [(raw(self.stacked), src, dim + 1)] if self.stacked is not None else [
            (raw(layer), chunk_layer, dim) for layer, chunk_layer in zip(self.layers, src)]
        per_block = (not src.is_cuda  # one kernel per layer is far cheaper on a GPU
                     and self.geometry.block_bytes >= _PER_BLOCK_SCATTER_BYTES)
        rows = None if per_block else self._as_rows(src)
        if rows is not None:
            rows[0].index_copy_(1, block_ids, rows[1])
            return
        for target, source, block_dim in targets:
            if per_block:  # index_copy_ runs at half the speed of copy_ on large blocks
                for position, block in enumerate(block_ids.tolist()):
                    target.select(block_dim, block).copy_(source.select(block_dim, position))
            else:
                target.index_copy_(block_dim, block_ids, source)

    def unmap(self) -> None:
        if self._populating is not None:
            self._populating.join()
        self.layers = []
        self.stacked = None
        self._stacked_rows.clear()
        self.host_rows = None
        for mapping in self.mappings:
            try:
                mapping.close()
            except BufferError:  # a view is still referenced somewhere; the GC unmaps it
                logger.warning("instance %d: mapping still referenced at unmap", self.instance_id)
        self.mappings = []
        self.lane = None
        for allocation in self.allocations:
            allocation.close()
        self.allocations = []


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise BadRequest(message)


@dataclass
class _Window:
    """The bytes of one memfd that a registration's layers span, from the page where the
    lowest one starts to where the highest one ends: all of it the server maps."""

    path: str  # the first layer in it, for messages
    name: str  # the segment's label
    start: int
    end: int

    def map(self, passed: Any) -> tuple[mmap.mmap, list[tuple[int, int]]]:
        """Map the window of the memfd of a ticket (`passed`: fd_channel.PassedFd, whose
        descriptor stays the channel's), and find which bytes of it hold data, as (offset in
        the mapping, length): what may be pre-faulted. Its seals forbid shrinking, so the
        mapping stays valid whatever the worker does to its end."""
        try:
            mapping = mmap.mmap(passed.fd, self.end - self.start, offset=self.start)
        except OSError as exc:
            raise BadRequest(f"`{self.path}`: cannot map memfd {self.name[:64]!r}: "
                             f"{exc.strerror}") from None
        runs = data_runs(passed.fd, self.start, self.end, MAX_PREFAULT_RUNS)
        return mapping, [(offset - self.start, length) for offset, length in runs]


def _release(counter: Counter, key: Any, amount: int) -> None:
    counter[key] -= amount
    if not counter[key]:
        del counter[key]


def _validate_handles(req: RegisterKVCacheRequest, chunk_size: int) -> tuple[Geometry, int]:
    _check(req.layout in LAYOUTS, f"`layout`: expected one of {sorted(LAYOUTS)}, got {req.layout!r}")
    _check(req.block_size > 0 and chunk_size % req.block_size == 0,
           f"`block_size`: {req.block_size} must be positive and divide the chunk size {chunk_size}")
    _check(0 < len(req.layers) <= MAX_LAYERS, f"`layers`: expected 1..{MAX_LAYERS} handles, "
           f"got {len(req.layers)}")
    _check(0 < req.kv_world_size <= MAX_KV_WORLD_SIZE,
           f"`kv_world_size`: must be in [1, {MAX_KV_WORLD_SIZE}]")
    _check(0 <= req.kv_worker_id < req.kv_world_size,
           f"`kv_worker_id`: {req.kv_worker_id} not in [0, {req.kv_world_size})")
    _check(0 <= req.tp_rank < MAX_KV_WORLD_SIZE, f"`tp_rank`: must be in [0, {MAX_KV_WORLD_SIZE})")
    _check(len(req.tp_group) <= MAX_NAME_CHARS, f"`tp_group`: at most {MAX_NAME_CHARS} characters")
    _check(0 < len(req.model) <= MAX_MODEL_CHARS, f"`model`: expected 1..{MAX_MODEL_CHARS} characters")
    first = req.layers[0]
    rank = LAYOUTS[req.layout]
    if first.kind == MemfdHandle.KIND:
        _check(not req.store_event, "`store_event`: only cuda_ipc registrations wait on an event")
    else:
        _check(len(req.store_event) in (0, CUDA_IPC_HANDLE_BYTES),
               f"`store_event`: expected {CUDA_IPC_HANDLE_BYTES} bytes (a cudaIpcEventHandle_t) "
               f"or none, got {len(req.store_event)}")
    for i, handle in enumerate(req.layers):
        where = f"layers[{i}]"
        _check(handle.kind == first.kind, f"`{where}.kind`: every layer needs the kind of "
               f"layers[0] ({first.kind!r}), got {handle.kind!r}")
        _check(len(getattr(handle, "name", "")) <= MAX_NAME_CHARS,
               f"`{where}.name`: at most {MAX_NAME_CHARS} characters")
        _check(handle.dtype in DTYPES, f"`{where}.dtype`: unsupported {handle.dtype!r}; "
               f"supported: {', '.join(DTYPES)}")
        _check(len(handle.shape) == rank and len(handle.strides) == rank,
               f"`{where}.shape`: layout {req.layout!r} needs {rank} dimensions, "
               f"got shape {handle.shape} and strides {handle.strides}")
        _check(all(d > 0 for d in handle.shape), f"`{where}.shape`: dimensions must be positive")
        _check(all(0 <= s < 2**63 for s in handle.strides),
               f"`{where}.strides`: must not be negative, and below 2**63")
        # No two elements on one address (so no block, K or V shares bytes with another, and
        # torch can count the elements once the span fits in the memory): smallest stride
        # first, each dimension must step past everything the ones inside it span.
        inner = 1
        for stride, size in sorted(zip(handle.strides, handle.shape)):
            _check(size == 1 or stride >= inner, f"`{where}`: shape {handle.shape} with "
                   f"strides {handle.strides} puts several elements on one address")
            inner += (size - 1) * stride
        _check(handle.offset >= 0 and handle.offset % DTYPES[handle.dtype].itemsize == 0,
               f"`{where}.offset`: must be a non-negative multiple of the element size")
        _check(handle.shape == first.shape and handle.dtype == first.dtype,
               f"`{where}`: every layer needs the shape and dtype of layers[0]")
    if req.layout == "mha":
        _check(first.shape[0] == 2, f"`layers[0].shape`: MHA layers are [2, num_blocks, "
               f"block_size, heads, head_dim], got {first.shape}")
        num_blocks, block_size = first.shape[1], first.shape[2]
        block_shape = (2, *first.shape[2:])
    else:
        num_blocks, block_size = first.shape[0], first.shape[1]
        block_shape = tuple(first.shape[1:])
    _check(block_size == req.block_size,
           f"`layers[0].shape`: block dimension {block_size} differs from block_size {req.block_size}")
    geometry = Geometry(req.layout, len(req.layers), block_shape, first.dtype,
                        chunk_size // req.block_size)
    return geometry, num_blocks


def _memory(handle: TensorHandle) -> str | bytes:
    """What names the memory a handle lies in: its segment, or its allocation's IPC handle."""
    return handle.ticket if isinstance(handle, MemfdHandle) else handle.ipc_handle


def _stack_layers(handles: list[TensorHandle], typed: torch.Tensor) -> torch.Tensor | None:
    """One strided view over all layers when they sit at equal distances in one buffer."""
    first = handles[0]
    itemsize = typed.element_size()
    step = handles[1].offset - first.offset if len(handles) > 1 else 0
    span = span_bytes(first.shape, first.strides, itemsize)
    if len(handles) > 1 and step < span:
        return None
    for i, handle in enumerate(handles):
        if (_memory(handle) != _memory(first) or handle.strides != first.strides
                or handle.offset != first.offset + i * step):
            return None
    return typed.as_strided([len(handles), *first.shape], [step // itemsize, *first.strides],
                            first.offset // itemsize)


class Tickets(Protocol):
    """The fd channel's tickets, as the registry uses them (fd_channel.FdChannel)."""

    def peek(self, ticket: bytes) -> Any: ...  # its PassedFd, or None
    def spend(self, ticket: bytes) -> None: ...


class Registry:
    """Every registered KV cache by instance id, and the clients that own them."""

    def __init__(self, chunk_size: int, clock: Callable[[], float],
                 tickets: Tickets, cuda_ipc: CudaIpcSupport | None = None,
                 watch: Watch | None = None):
        """`tickets`: the fd channel's, which memfd handles name;
        `cuda_ipc`: how to map cuda_ipc handles; None on a server without CUDA;
        `watch`: the fd channel's watches, which end a registration when its worker hangs up."""
        self.chunk_size = chunk_size
        self.clock = clock
        self.tickets = tickets
        self.cuda_ipc = cuda_ipc
        self.watch = watch
        self._instances: dict[int, KVCacheInstance] = {}
        # The same by the connection that owns them, and by engine: every request refreshes
        # its connection's registrations, and an MLA RETRIEVE finds its leader's TP group,
        # neither by a walk over everyone's (up to MAX_REGISTRATIONS).
        self._by_owner: dict[bytes, dict[int, KVCacheInstance]] = {}
        self._by_engine: dict[bytes, dict[int, KVCacheInstance]] = {}
        # Bytes of memfd extents registered, by connection and by the uid that sent them.
        self._bytes_of_owner: Counter[bytes] = Counter()
        self._bytes_of_uid: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._instances)

    def register(self, owner: bytes, engine: bytes, req: RegisterKVCacheRequest,
                 uid: int | None = None) -> KVCacheInstance:
        """Map a worker's cache for connection `owner` of `engine`, whose peer is `uid` (None:
        unknown) (access.Session). A refusal leaves every ticket it names unspent."""
        # Each mapping holds a descriptor in this process: bounded, so no client can use up
        # the server's descriptors (and with them every other client's connections).
        _check(len(self._instances) < MAX_REGISTRATIONS,
               f"the server holds {MAX_REGISTRATIONS} registrations already (MAX_REGISTRATIONS)")
        mine = len(self._by_owner.get(owner, ()))
        _check(mine < MAX_REGISTRATIONS_PER_CONNECTION,
               f"this connection holds {mine} registrations already; the limit is "
               f"{MAX_REGISTRATIONS_PER_CONNECTION} (MAX_REGISTRATIONS_PER_CONNECTION): "
               f"unregister one first")
        geometry, num_blocks = _validate_handles(req, self.chunk_size)
        dtype = DTYPES[geometry.dtype]
        memfd = req.layers[0].kind == MemfdHandle.KIND
        passed = self._usable_tickets(req, engine, uid) if memfd else {}
        mappings: dict[bytes, mmap.mmap] = {}
        allocations: dict[bytes, Allocation] = {}
        prefault: list[tuple[mmap.mmap, int, int]] = []
        registered: Counter[int] = Counter()
        handles = req.layers
        stop_watching = None
        try:
            if memfd:
                sizes = {ticket: p.size for ticket, p in passed.items()}
            else:
                _check(self.cuda_ipc is not None, "`layers[0].kind`: this server has no CUDA, "
                       "so it cannot map cuda_ipc handles; register shm handles")
                allocations = open_allocations(req.layers, self.cuda_ipc)
                sizes = {key: a.data.numel() for key, a in allocations.items()}
            ends = []
            for i, handle in enumerate(req.layers):
                size = sizes[_memory(handle)]
                end = handle.offset + span_bytes(handle.shape, handle.strides, dtype.itemsize)
                where = (f"memfd {handle.name[:64]!r}" if isinstance(handle, MemfdHandle)
                         else "its CUDA allocation")
                _check(end <= size, f"`layers[{i}]`: tensor ends at byte {end} but {where} "
                       f"holds {size} bytes")
                ends.append(end)
            if memfd:
                windows = self._windows(owner, req.layers, ends, passed)
                for ticket, window in windows.items():
                    mappings[ticket], runs = window.map(passed[ticket])
                    prefault += [(mappings[ticket], offset, length) for offset, length in runs]
                    registered[passed[ticket].uid] += window.end - window.start
                # Each mapping starts at its window: offsets count from there.
                handles = [replace(h, offset=h.offset - windows[h.ticket].start) for h in handles]
            instance_id = self._new_id()
            stop_watching = self._watch(req.watch, instance_id) if req.watch else None
            # Views only once nothing can fail: a segment with views cannot be closed.
            buffers = ({name: torch.frombuffer(m, dtype=torch.uint8) for name, m in mappings.items()}
                       if mappings else {key: a.data for key, a in allocations.items()})
            typed = {key: raw[:raw.numel() - raw.numel() % dtype.itemsize].view(dtype)
                     for key, raw in buffers.items()}
            layers = [typed[_memory(h)].as_strided(h.shape, h.strides, h.offset // dtype.itemsize)
                      for h in handles]
            stacked = _stack_layers(handles, typed[_memory(handles[0])])
            lane = None
            if allocations:
                try:
                    lane = self.cuda_ipc.new_lane(layers[0].device, geometry, req.store_event)
                except RuntimeError as exc:  # the event handle does not open, or no memory
                    raise BadRequest(f"`store_event`: cannot set up GPU copies for this cache "
                                     f"({exc})") from None
        except BaseException:  # only cuda_ipc can fail after the views exist: they hold no mmap
            if stop_watching is not None:
                stop_watching()
            for mapping in mappings.values():
                mapping.close()
            for allocation in allocations.values():
                allocation.close()
            raise
        for ticket in passed:  # registered: only now are the tickets used up
            self.tickets.spend(ticket)
        instance = KVCacheInstance(
            instance_id=instance_id, owner=owner, engine=engine, model=req.model,
            kv_world_size=req.kv_world_size, kv_worker_id=req.kv_worker_id, tp_rank=req.tp_rank,
            tp_group=req.tp_group,
            num_blocks=num_blocks, geometry=geometry, layers=layers, stacked=stacked,
            mappings=list(mappings.values()), last_seen=self.clock(),
            allocations=list(allocations.values()), lane=lane, stop_watching=stop_watching,
            host_rows=HostRows.of(layers, stacked, geometry.block_dim), prefault=prefault,
            registered=registered)
        self._instances[instance.instance_id] = instance
        self._bytes_of_owner[owner] += registered.total()
        self._bytes_of_uid.update(registered)
        for index, key in ((self._by_owner, owner), (self._by_engine, engine)):
            index.setdefault(key, {})[instance.instance_id] = instance
        instance.start_populating()
        logger.info("registered instance %d: model %s, kv worker %d/%d, %d layers on %s, "
                    "%d blocks, %d bytes per chunk%s", instance.instance_id, req.model,
                    req.kv_worker_id, req.kv_world_size, geometry.num_layers, layers[0].device,
                    num_blocks, geometry.chunk_bytes,
                    "" if stacked is not None else " (per-layer copies)")
        return instance

    def _usable_tickets(self, req: RegisterKVCacheRequest, engine: bytes, uid: int | None
                        ) -> dict[bytes, Any]:
        """The fd channel's PassedFd for each ticket the layers name, once each is known to
        serve this session: sent by its uid and, if a binding asked for it, for its engine.
        Nothing is spent, so a refusal leaves the ticket to its rightful user."""
        passed = {}
        for i, handle in enumerate(req.layers):
            if handle.ticket in passed:
                continue
            path = f"`layers[{i}].ticket`"
            _check(len(handle.ticket) == TICKET_BYTES, f"{path}: expected {TICKET_BYTES} bytes "
                   f"from the fd channel, got {len(handle.ticket)}")
            found = self.tickets.peek(handle.ticket)
            _check(found is not None, f"{path}: unknown or expired ticket (for segment "
                   f"{handle.name[:64]!r}): send the memfd to the fd channel (HELLO's "
                   f"fd_socket) and register within a minute")
            kept = "refused, and the ticket kept for the session it serves"
            _check(uid is None or found.uid == uid, f"{path}: another uid sent its memfd; a "
                   f"ticket serves only sessions of the uid that sent the descriptor ({kept})")
            _check(found.engine is None or found.engine == engine, f"{path}: it was issued "
                   f"to a session of another engine; a ticket serves only the engine whose "
                   f"fd_binding asked for it ({kept})")
            _check(found.engine is not None or uid is not None, f"{path}: it is bound to no "
                   f"engine (a version 1 request, {FD_CHANNEL_MAGIC!r}) and this session's uid is "
                   f"unknown (tcp://): ask for tickets with HELLO's fd_binding ({kept})")
            passed[handle.ticket] = found
        return passed

    def _windows(self, owner: bytes, handles: list[TensorHandle], ends: list[int],
                 passed: dict[bytes, Any]) -> dict[bytes, _Window]:
        """Per ticket, the window of its memfd that the layers span (`ends`: where each
        layer's bytes end). Refused for a memfd much larger than its window, or past the
        registered bytes a connection or a uid may have."""
        windows: dict[bytes, _Window] = {}
        for i, (h, end) in enumerate(zip(handles, ends)):
            start = h.offset - h.offset % mmap.ALLOCATIONGRANULARITY
            window = windows.setdefault(h.ticket, _Window(f"layers[{i}]", h.name, start, end))
            window.start, window.end = min(window.start, start), max(window.end, end)
        adding: Counter[int] = Counter()
        for ticket, window in windows.items():
            size, extent = passed[ticket].size, window.end - window.start
            _check(size <= 2 * extent + SEGMENT_SLACK_BYTES, f"`{window.path}`: memfd "
                   f"{window.name[:64]!r} holds {size} bytes, but its layers span {extent} "
                   f"(bytes {window.start} to {window.end}); a segment may hold at most twice "
                   f"its layers' extent and {SEGMENT_SLACK_BYTES} bytes more: size it to the "
                   f"cache")
            adding[passed[ticket].uid] += extent
        mine = self._bytes_of_owner[owner]
        _check(mine + adding.total() <= MAX_REGISTERED_BYTES_PER_CONNECTION,
               f"`layers`: this connection has {mine} bytes of worker memory registered; "
               f"{adding.total()} more would pass MAX_REGISTERED_BYTES_PER_CONNECTION "
               f"({MAX_REGISTERED_BYTES_PER_CONNECTION}): unregister a cache first")
        for sender, nbytes in adding.items():
            theirs = self._bytes_of_uid[sender]
            _check(theirs + nbytes <= MAX_REGISTERED_BYTES_PER_UID,
                   f"`layers`: uid {sender}'s memfds are registered for {theirs} bytes; "
                   f"{nbytes} more would pass MAX_REGISTERED_BYTES_PER_UID "
                   f"({MAX_REGISTERED_BYTES_PER_UID}): unregister caches of that uid first")
        return windows

    def _watch(self, token: bytes, instance_id: int) -> Callable[[], None]:
        """Drop the registration as soon as the worker's watch connection hangs up."""
        _check(self.watch is not None, "`watch`: this server takes no watches")
        _check(len(token) == TICKET_BYTES, f"`watch`: expected {TICKET_BYTES} bytes from the "
               f"fd channel, got {len(token)}")

        def hung_up() -> None:
            if instance_id in self._instances:
                logger.info("instance %d: its worker hung up its watch (it exited); "
                               "dropping its registration", instance_id)
                self.unregister(instance_id)
        stop = self.watch(token, hung_up)
        _check(stop is not None, "`watch`: unknown, expired or closed watch: open one on the "
               "fd channel (HELLO's fd_socket) and register within a minute, keeping it open")
        return stop

    def _new_id(self) -> int:
        # Random, so that an id a client kept from before a server restart names nothing.
        while True:
            instance_id = secrets.randbits(53) or 1  # exact in every msgpack implementation
            if instance_id not in self._instances:
                return instance_id

    def get(self, instance_id: int, owner: bytes) -> KVCacheInstance:
        """The instance, if this connection registered it."""
        instance = self._instances.get(instance_id)
        if instance is None or instance.owner != owner:
            raise UnknownInstance(f"no KV cache with instance_id {instance_id} is registered "
                                  f"by this connection; register it (again) first")
        return instance

    def owns_any(self, owner: bytes) -> bool:
        return owner in self._by_owner

    def seen(self, owner: bytes) -> None:
        mine = self._by_owner.get(owner)
        if mine:
            now = self.clock()
            for instance in mine.values():
                instance.last_seen = now

    def unregister(self, instance_id: int) -> None:
        instance = self._instances.pop(instance_id)
        _release(self._bytes_of_owner, instance.owner, instance.registered.total())
        for sender, nbytes in instance.registered.items():
            _release(self._bytes_of_uid, sender, nbytes)
        for index, key in ((self._by_owner, instance.owner), (self._by_engine, instance.engine)):
            group = index[key]
            del group[instance_id]
            if not group:
                del index[key]
        instance.closed = True
        if instance.stop_watching is not None:
            instance.stop_watching()
        if instance.copies_in_flight == 0:
            instance.unmap()
        logger.info("unregistered instance %d", instance_id)

    def copy_finished(self, instance: KVCacheInstance) -> None:
        instance.copies_in_flight -= 1
        if instance.closed and instance.copies_in_flight == 0:
            instance.unmap()

    def expired(self, timeout: float) -> list[int]:
        deadline = self.clock() - timeout
        return [i.instance_id for i in self._instances.values() if i.last_seen < deadline]

    def instance_ids(self) -> list[int]:
        return list(self._instances)

    def instances(self) -> list[KVCacheInstance]:
        return list(self._instances.values())

    def tp_followers(self, leader: KVCacheInstance) -> list[KVCacheInstance]:
        """Under MLA, the other ranks of the leader's TP group: the same engine (the secret
        its sessions share) and tp_group, model, kv rank, cache shape and handle kind, so
        they take the same chunks into the same blocks. Nobody outside the engine can join."""
        if leader.geometry.layout != "mla":
            return []
        return [i for i in self._by_engine[leader.engine].values()
                if i is not leader and i.tp_rank != leader.tp_rank
                and i.tp_group == leader.tp_group and i.model == leader.model
                and i.kv_world_size == leader.kv_world_size
                and i.kv_worker_id == leader.kv_worker_id and i.geometry == leader.geometry
                and i.num_blocks == leader.num_blocks
                and (i.lane is None) == (leader.lane is None)]  # both on GPUs, or both not
