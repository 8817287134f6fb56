"""Worker KV caches in GPU memory: cuda_ipc handles for CUDA tensors, and the STORE event.

A layer tensor rarely starts its CUDA allocation (torch's caching allocator carves many
tensors out of one cudaMalloc), and CUDA IPC shares whole allocations: each tensor is sent
as (the IPC handle of its allocation, its byte offset in it). Only cudaMalloc memory can be
shared so: each tensor's memory is checked first, and memory from another allocator is
refused with the setting to change. The arithmetic and that decision are pure functions
that take the driver's answers as parameters, so they are tested without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .. import cuda
from ..protocol import CudaIpcHandle, span_bytes


@dataclass(frozen=True)
class Allocation:
    """A CUDA allocation: [base, base + size) on one device."""

    device: int
    base: int
    size: int

    def holds(self, device: int, start: int, end: int) -> bool:
        return device == self.device and self.base <= start and end <= self.base + self.size


@dataclass(frozen=True)
class Placement:
    """Where a tensor lies: the index of its allocation in the list, and its byte offset."""

    allocation: int
    offset: int


def place_tensors(extents: Sequence[tuple[int, int, int]],
                  find_allocation: Callable[[int, int], tuple[int, int]]
                  ) -> tuple[list[Allocation], list[Placement]]:
    """Group tensors by allocation. `extents` are (device, first byte address, span in
    bytes); `find_allocation(device, address)` gives (base, size) of the allocation holding
    an address, and is asked once per allocation, not once per tensor.

    Raises ValueError naming the tensor (by position) that does not fit its allocation.
    """
    allocations: list[Allocation] = []
    placements = []
    for i, (device, start, span) in enumerate(extents):
        end = start + span
        found = next((a for a, allocation in enumerate(allocations)
                      if allocation.holds(device, start, start + 1)), None)
        if found is None:
            base, size = find_allocation(device, start)
            allocations.append(Allocation(device, base, size))
            found = len(allocations) - 1
        allocation = allocations[found]
        if not allocation.holds(device, start, end):
            raise ValueError(f"tensor {i} spans bytes [{start:#x}, {end:#x}), beyond its CUDA "
                             f"allocation [{allocation.base:#x}, "
                             f"{allocation.base + allocation.size:#x}) on device {device}")
        placements.append(Placement(found, start - allocation.base))
    return allocations, placements


def allocator_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """torch's caching allocator options from the environment, as {lowercased option:
    lowercased value}: those of PYTORCH_ALLOC_CONF (the newer name) and of
    PYTORCH_CUDA_ALLOC_CONF together, since either may be what this torch reads."""
    text = ",".join(environ.get(name, "") for name in ("PYTORCH_ALLOC_CONF",
                                                        "PYTORCH_CUDA_ALLOC_CONF"))
    settings = {}
    for entry in text.split(","):
        option, _, value = entry.partition(":")
        if option.strip():
            settings[option.strip().lower()] = value.strip().lower()
    return settings


def export_refusal(i: int, capable: bool, settings: Mapping[str, str]) -> str | None:
    """Why tensor `i` cannot be shared by CUDA IPC, and what to change; None when it can.
    `capable`: the driver's IS_LEGACY_CUDA_IPC_CAPABLE for the tensor's address; `settings`:
    allocator_settings() of the worker's environment, which name the likely cause."""
    if capable:
        return None
    if settings.get("expandable_segments") == "true":
        cause = ("PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) sets "
                 "expandable_segments:True, whose segments are cuMem mappings: start the "
                 "worker without it (unset it, or set expandable_segments:False)")
    elif settings.get("backend") == "cudamallocasync":
        cause = ("PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) sets backend:cudaMallocAsync, "
                 "whose memory comes from a stream-ordered pool: start the worker without it")
    else:
        cause = ("it was allocated with cuMem* or from a memory pool; in vLLM that is sleep "
                 "mode (--enable-sleep-mode), whose allocator maps the KV cache with cuMem: "
                 "start vLLM without it (or register a CPU cache in shared memory instead)")
    return (f"tensor {i} lies in GPU memory that CUDA IPC cannot share (only cudaMalloc "
            f"memory can be exported with cudaIpcGetMemHandle): {cause}")


def _extent(i: int, tensor: torch.Tensor) -> tuple[int, int, int]:
    if tensor.device.type != "cuda":
        raise ValueError(f"tensor {i} is on {tensor.device}, not on a CUDA device")
    if any(stride < 0 for stride in tensor.stride()):
        raise ValueError(f"tensor {i} has a negative stride: {tensor.stride()}")
    return (tensor.device.index, tensor.data_ptr(),
            span_bytes(list(tensor.shape), list(tensor.stride()), tensor.element_size()))


def _find_allocation(device: int, address: int) -> tuple[int, int]:
    with torch.cuda.device(device):
        return cuda.address_range(address)


def _check_exportable(extents: Sequence[tuple[int, int, int]]) -> None:
    settings = allocator_settings(os.environ)
    for i, (device, start, _) in enumerate(extents):
        with torch.cuda.device(device):
            refusal = export_refusal(i, cuda.legacy_ipc_capable(start), settings)
        if refusal is not None:
            raise ValueError(refusal)


def cuda_ipc_handles(tensors: Sequence[torch.Tensor]) -> list[CudaIpcHandle]:
    """One cuda_ipc handle per CUDA tensor; tensors in one allocation share its IPC handle.

    The server maps the allocations while the registration lasts: keep the tensors (and
    so their memory) alive until it ends. Raises ValueError for a tensor not on a GPU, or
    in memory CUDA IPC cannot share (saying which allocator setting to change).
    """
    extents = [_extent(i, t) for i, t in enumerate(tensors)]
    # Before any range arithmetic: a cuMem mapping's range is not what IPC would share.
    _check_exportable(extents)
    allocations, placements = place_tensors(extents, _find_allocation)
    exported = [cuda.export_allocation(a.device, a.base) for a in allocations]
    uuids = {a.device: cuda.device_uuid(a.device) for a in allocations}
    return [CudaIpcHandle(ipc_handle=exported[p.allocation], offset=p.offset,
                          device_uuid=uuids[allocations[p.allocation].device],
                          shape=list(t.shape), strides=list(t.stride()),
                          dtype=str(t.dtype).removeprefix("torch."))
            for t, p in zip(tensors, placements)]


class StoreEvent:
    """An interprocess CUDA event that the server's copies for a STORE wait on.

    Register `handle` (REGISTER_KV_CACHE's store_event) and call record() on the thread
    that runs the forward pass, after it and before each STORE: the server then reads the
    blocks only once the work queued so far on that stream has written them.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.event = torch.cuda.Event(interprocess=True)
        self.record()  # an event must be recorded once before its handle is exported
        self.handle = bytes(self.event.ipc_handle())

    def record(self) -> None:
        self.event.record(torch.cuda.current_stream(self.device))
