"""CUDA helpers that the server and the client share: device UUIDs, allocation ranges, IPC handles.

Everything CUDA is imported on first use (torch.cuda, cupy, libcuda), so this module
imports, and its pure functions run, on machines without a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from typing import Any

import torch

_HEX32 = re.compile(r"[0-9a-f]{32}")
# cuda.h's CUpointer_attribute: 1 if cudaIpcGetMemHandle can export the pointer's allocation.
_IS_LEGACY_CUDA_IPC_CAPABLE = 10


def normalize_uuid(text: str) -> str:
    """A GPU UUID as 8-4-4-4-12 lowercase hex, from nvidia-smi's `GPU-…` form, torch's, or
    32 bare hex digits."""
    digits = text.strip().lower().removeprefix("gpu-").replace("-", "")
    if not _HEX32.fullmatch(digits):
        raise ValueError(f"not a GPU UUID: {text[:60]!r}")
    return "-".join((digits[:8], digits[8:12], digits[12:16], digits[16:20], digits[20:]))


def device_uuid(index: int) -> str:
    """The UUID of CUDA device `index` (as this process numbers its visible devices)."""
    return normalize_uuid(str(torch.cuda.get_device_properties(index).uuid))


def device_index(uuid: str) -> int | None:
    """This process's index of the visible device with that UUID, or None."""
    wanted = normalize_uuid(uuid)
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == wanted:
            return index
    return None


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                            ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    lib.cuMemGetAddressRange_v2.restype = ctypes.c_int
    lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    lib.cuPointerGetAttribute.restype = ctypes.c_int
    return lib


def address_range(pointer: int) -> tuple[int, int]:
    """(base, size) of the CUDA allocation that holds `pointer`; the caller has made the
    pointer's device current (torch.cuda.device or cupy.cuda.Device)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    result = _libcuda().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), pointer)
    if result != 0:
        raise RuntimeError(f"cuMemGetAddressRange({pointer:#x}) failed with CUresult {result}")
    return base.value, size.value


def legacy_ipc_capable(pointer: int) -> bool:
    """Whether cudaIpcGetMemHandle can export the allocation that holds `pointer`: true for
    cudaMalloc memory, false for cuMem (VMM) mappings and stream-ordered pools. The caller
    has made the pointer's device current."""
    capable = ctypes.c_uint(0)  # the driver writes a boolean into its first byte or all four
    result = _libcuda().cuPointerGetAttribute(ctypes.byref(capable), _IS_LEGACY_CUDA_IPC_CAPABLE,
                                              pointer)
    if result != 0:
        raise RuntimeError(f"cuPointerGetAttribute({pointer:#x}, IS_LEGACY_CUDA_IPC_CAPABLE) "
                           f"failed with CUresult {result}")
    return bool(capable.value)


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError("CUDA IPC needs cupy (pip install cupy-cuda12x or cupy-cuda13x, "
                           "matching torch's CUDA)") from exc
    return cupy


def export_allocation(device: int, base: int) -> bytes:
    """The cudaIpcMemHandle_t of the allocation starting at `base` on `device`."""
    cupy = _cupy()
    with cupy.cuda.Device(device):
        return bytes(cupy.cuda.runtime.ipcGetMemHandle(base))


@dataclass(eq=False)
class IpcAllocation:
    """Another process's CUDA allocation, opened in this one; `data` is all of it as bytes."""

    data: torch.Tensor
    pointer: int
    device: int

    def close(self) -> None:
        cupy = _cupy()
        self.data = torch.empty(0, dtype=torch.uint8)  # no view of memory about to be unmapped
        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.ipcCloseMemHandle(self.pointer)


def new_stream(device: int) -> torch.cuda.ExternalStream:
    """A CUDA stream of its own on `device` (non-blocking, as torch's are), for torch to queue
    work on; the CUDA stream lives as long as the object returned (it keeps cupy's owner,
    whose collection destroys it once the work queued there has finished)."""
    cupy = _cupy()
    with cupy.cuda.Device(device):
        owner = cupy.cuda.Stream(non_blocking=True)
    stream = torch.cuda.ExternalStream(owner.ptr, device=torch.device("cuda", device))
    stream.owner = owner  # type: ignore[attr-defined]
    return stream


def device_bytes(cupy: Any, pointer: int, size: int, device: int) -> torch.Tensor:
    """`size` bytes of device memory at `pointer` on `device`, as a uint8 tensor, without a
    copy: a cupy array over memory it does not own, handed to torch through DLPack (which,
    unlike __cuda_array_interface__ and torch.as_tensor, needs no NumPy on any torch)."""
    memory = cupy.cuda.UnownedMemory(pointer, size, None, device)
    array = cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.from_dlpack(array)  # the tensor keeps the array, and so the memory object


def open_allocation(handle: bytes, device: int) -> IpcAllocation:
    """Open a cudaIpcMemHandle_t on `device`: the whole allocation, viewed as a uint8 tensor."""
    cupy = _cupy()
    with cupy.cuda.Device(device):
        pointer = cupy.cuda.runtime.ipcOpenMemHandle(
            handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
        try:
            base, size = address_range(pointer)
            data = device_bytes(cupy, base, size, device)
        except BaseException:
            cupy.cuda.runtime.ipcCloseMemHandle(pointer)
            raise
    return IpcAllocation(data, pointer, device)
