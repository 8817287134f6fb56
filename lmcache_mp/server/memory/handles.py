"""A REGISTER_KV_CACHE's handles, checked: the protocol's rules, the layers' geometry, windows."""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import BadRequest
from ...memory import data_runs
from ...protocol import (
    CUDA_IPC_HANDLE_BYTES,
    MemfdHandle,
    RegisterKVCacheRequest,
    TensorHandle,
    span_bytes,
)
from .geometry import DTYPES, LAYOUTS, Geometry

# Runs of a segment's data pre-faulted at most: a segment more fragmented than that is the
# worker's doing, and the rest of its pages fault in at their first copy.
MAX_PREFAULT_RUNS = 1024


def check(condition: bool, message: str) -> None:
    if not condition:
        raise BadRequest(message)


@dataclass
class Window:
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


def validate_handles(req: RegisterKVCacheRequest, chunk_size: int) -> tuple[Geometry, int]:
    """The cache's geometry and block count, from handles the decoder let through (each
    field's range and length it checked: protocol/messages.py); BadRequest naming the
    first rule they break that spans fields."""
    _check_fields(req, chunk_size)
    first = req.layers[0]
    for i, handle in enumerate(req.layers):
        _check_layer(f"layers[{i}]", handle, first, req.layout)
    num_blocks, block_size, block_shape = _blocks_of(req)
    check(block_size == req.block_size,
          f"`layers[0].shape`: block dimension {block_size} differs from block_size "
          f"{req.block_size}")
    geometry = Geometry(req.layout, len(req.layers), block_shape, first.dtype,
                        chunk_size // req.block_size)
    return geometry, num_blocks


def _check_fields(req: RegisterKVCacheRequest, chunk_size: int) -> None:
    """The rules on the request's own fields: layout, block size, kv worker, store event."""
    check(req.layout in LAYOUTS,
          f"`layout`: expected one of {sorted(LAYOUTS)}, got {req.layout!r}")
    check(req.block_size > 0 and chunk_size % req.block_size == 0,
          f"`block_size`: {req.block_size} must be positive and divide the chunk size "
          f"{chunk_size}")
    check(req.layout != "state" or req.block_size == chunk_size,
          f"`block_size`: a \"state\" registration holds one state per chunk, so its "
          f"block_size is the chunk size {chunk_size}, got {req.block_size}")
    check(0 <= req.kv_worker_id < req.kv_world_size,
          f"`kv_worker_id`: {req.kv_worker_id} not in [0, {req.kv_world_size})")
    if req.layers[0].kind == MemfdHandle.KIND:
        check(not req.store_event, "`store_event`: only cuda_ipc registrations wait on an event")
    else:
        check(len(req.store_event) in (0, CUDA_IPC_HANDLE_BYTES),
              f"`store_event`: expected {CUDA_IPC_HANDLE_BYTES} bytes (a cudaIpcEventHandle_t) "
              f"or none, got {len(req.store_event)}")


def _check_layer(where: str, handle: TensorHandle, first: TensorHandle, layout: str) -> None:
    """One layer's handle: of layers[0]'s kind, shape and dtype, with strides that put no
    two elements on one address, at an offset the element size divides."""
    rank = LAYOUTS[layout]
    check(handle.kind == first.kind, f"`{where}.kind`: every layer needs the kind of "
          f"layers[0] ({first.kind!r}), got {handle.kind!r}")
    check(handle.dtype in DTYPES, f"`{where}.dtype`: unsupported {handle.dtype!r}; "
          f"supported: {', '.join(DTYPES)}")
    check(len(handle.shape) == rank and len(handle.strides) == rank,
          f"`{where}.shape`: layout {layout!r} needs {rank} dimensions, "
          f"got shape {handle.shape} and strides {handle.strides}")
    check(all(d > 0 for d in handle.shape), f"`{where}.shape`: dimensions must be positive")
    check(all(0 <= s < 2**63 for s in handle.strides),
          f"`{where}.strides`: must not be negative, and below 2**63")
    # No two elements on one address (so no block, K or V shares bytes with another, and
    # torch can count the elements once the span fits in the memory): smallest stride
    # first, each dimension must step past everything the ones inside it span.
    inner = 1
    for stride, size in sorted(zip(handle.strides, handle.shape)):
        check(size == 1 or stride >= inner, f"`{where}`: shape {handle.shape} with "
              f"strides {handle.strides} puts several elements on one address")
        inner += (size - 1) * stride
    check(handle.offset >= 0 and handle.offset % DTYPES[handle.dtype].itemsize == 0,
          f"`{where}.offset`: must be a non-negative multiple of the element size")
    check(handle.shape == first.shape and handle.dtype == first.dtype,
          f"`{where}`: every layer needs the shape and dtype of layers[0]")


def _blocks_of(req: RegisterKVCacheRequest) -> tuple[int, int, tuple[int, ...]]:
    """The layers' block count, block dimension and one block's shape, by layout."""
    first = req.layers[0]
    if req.layout == "mha":
        check(first.shape[0] == 2, f"`layers[0].shape`: MHA layers are [2, num_blocks, "
              f"block_size, heads, head_dim], got {first.shape}")
        return first.shape[1], first.shape[2], (2, *first.shape[2:])
    if req.layout == "mla":
        return first.shape[0], first.shape[1], tuple(first.shape[1:])
    # a state: one block is the whole state, whatever block_size says
    return first.shape[0], req.block_size, tuple(first.shape[1:])


def memory_of(handle: TensorHandle) -> bytes:
    """What names the memory a handle lies in: its segment, or its allocation's IPC handle."""
    return handle.ticket if isinstance(handle, MemfdHandle) else handle.ipc_handle


def stack_layers(handles: list[TensorHandle], typed: torch.Tensor) -> torch.Tensor | None:
    """One strided view over all layers when they sit at equal distances in one buffer."""
    first = handles[0]
    itemsize = typed.element_size()
    step = handles[1].offset - first.offset if len(handles) > 1 else 0
    span = span_bytes(first.shape, first.strides, itemsize)
    if len(handles) > 1 and step < span:
        return None
    for i, handle in enumerate(handles):
        if (memory_of(handle) != memory_of(first) or handle.strides != first.strides
                or handle.offset != first.offset + i * step):
            return None
    return typed.as_strided([len(handles), *first.shape], [step // itemsize, *first.strides],
                            first.offset // itemsize)
