"""Mapping cuda_ipc handles: each allocation opened once per registration, on its GPU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...errors import BadRequest
from ...protocol import CUDA_IPC_HANDLE_BYTES, CudaIpcHandle


class Allocation(Protocol):
    """An opened allocation (lmcache_mp.cuda.IpcAllocation): its bytes, and how to let go."""

    data: torch.Tensor  # uint8, the whole allocation, on its device

    def close(self) -> None: ...


class SharedAllocations:
    """Opened allocations, counted by the registrations that use them.

    CUDA opens an IPC handle only once per process: a worker that registers the same memory
    again while its old registration is still mapped (it timed out with copies in flight)
    shares the opened allocation, which is closed when its last registration lets go.
    """

    def __init__(self, open_allocation: Callable[[bytes, int], Allocation]):
        self._open = open_allocation
        self._opened: dict[tuple[bytes, int], tuple[Allocation, int]] = {}

    def __len__(self) -> int:
        return len(self._opened)

    def open(self, handle: bytes, device: int) -> Allocation:
        key = (handle, device)
        allocation, users = self._opened.get(key) or (self._open(handle, device), 0)
        self._opened[key] = (allocation, users + 1)
        return _Use(allocation, lambda: self._release(key))

    def _release(self, key: tuple[bytes, int]) -> None:
        allocation, users = self._opened[key]
        if users > 1:
            self._opened[key] = (allocation, users - 1)
        else:
            del self._opened[key]
            allocation.close()


class _Use:
    """One registration's use of a shared allocation; close() lets go of it once."""

    def __init__(self, allocation: Allocation, release: Callable[[], None]):
        self.data = allocation.data
        self._release: Callable[[], None] | None = release

    def close(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            self.data = self.data.new_empty(0)  # no view of memory about to be unmapped
            release()


@dataclass(frozen=True)
class CudaIpcSupport:
    """What registering cuda_ipc handles takes; the server builds it from CUDA, tests from fakes."""

    open_allocation: Callable[[bytes, int], Allocation]  # (cudaIpcMemHandle_t, device index)
    device_index: Callable[[str], int | None]  # the visible device with this UUID
    new_lane: Callable[[torch.device, Any, bytes], Any]  # (device, Geometry, store_event) -> Lane


def open_allocations(handles: list[CudaIpcHandle], support: CudaIpcSupport
                     ) -> dict[bytes, Allocation]:
    """Every distinct allocation the handles name, opened once, all on one GPU.

    Raises BadRequest naming the handle that is wrong; nothing stays open then.
    """
    opened: dict[bytes, Allocation] = {}
    try:
        for i, handle in enumerate(handles):
            path = f"layers[{i}]"
            if handle.ipc_handle in opened:
                continue
            if len(handle.ipc_handle) != CUDA_IPC_HANDLE_BYTES:
                raise BadRequest(f"`{path}.ipc_handle`: expected {CUDA_IPC_HANDLE_BYTES} bytes "
                                 f"(a cudaIpcMemHandle_t), got {len(handle.ipc_handle)}")
            try:
                index = support.device_index(handle.device_uuid)
            except ValueError as exc:
                raise BadRequest(f"`{path}.device_uuid`: {exc}") from None
            if index is None:
                raise BadRequest(f"`{path}.device_uuid`: no GPU with UUID "
                                 f"{handle.device_uuid!r} is visible to the server")
            try:
                opened[handle.ipc_handle] = support.open_allocation(handle.ipc_handle, index)
            except Exception as exc:  # noqa: BLE001 (cupy and the driver raise their own types)
                raise BadRequest(f"`{path}.ipc_handle`: cannot open it on GPU {index} "
                                 f"({type(exc).__name__}: {exc}); the worker must run on this "
                                 f"machine, CUDA IPC must be allowed between the two processes, "
                                 f"and the handle must come from cudaIpcGetMemHandle of "
                                 f"cudaMalloc memory, not from a cuMem or pool allocator "
                                 f"(expandable_segments, cudaMallocAsync, vLLM's sleep mode), "
                                 f"which lmcache_mp.client.cuda.cuda_ipc_handles refuses") from None
            devices = {a.data.device for a in opened.values()}
            if len(devices) > 1:
                raise BadRequest(f"`{path}.device_uuid`: the layers of one KV cache must be on "
                                 f"one GPU, got {sorted(map(str, devices))}")
    except BaseException:
        for allocation in opened.values():
            allocation.close()
        raise
    return opened
